"""``flashot demo``: color transfer between two pictures by entropic optimal transport.

Grace Hopper's portrait is repainted with the colors of a shaded-relief map of
the Jacksboro fault, both shipped with matplotlib (no download). The pixels of
each picture form a cloud in RGB space; flashot solves the entropic OT problem
between subsampled clouds, and the entropic map ``z ↦ Σ_j softmax_j((g_j −
|z − y_j|²)/ε) y_j`` recolors every pixel of the full picture. Uses the public
API only.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

import flashot

__all__ = ["run_demo"]


def _pictures():
    """(portrait (H, W, 3), relief (H', W', 3)) as float arrays in [0, 1]."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import cbook
        from matplotlib.colors import LightSource
    except ImportError as err:  # pragma: no cover - matplotlib is a demo dependency
        raise SystemExit("flashot demo needs matplotlib: pip install 'flashot[demo]'") from err
    portrait = plt.imread(cbook.get_sample_data("grace_hopper.jpg")).astype(np.float64) / 255.0
    elevation = cbook.get_sample_data("jacksboro_fault_dem.npz")["elevation"]
    relief = LightSource(azdeg=315, altdeg=45).shade(
        elevation, cmap=plt.get_cmap("gist_earth"), vert_exag=0.05, blend_mode="overlay"
    )[..., :3]
    return portrait, relief


def _sample(pixels: np.ndarray, n: int, rng: np.random.Generator) -> torch.Tensor:
    flat = pixels.reshape(-1, 3)
    idx = rng.choice(flat.shape[0], size=min(n, flat.shape[0]), replace=False)
    return torch.from_numpy(flat[idx].astype(np.float32))


def run_demo(
    out: str | Path = "flashot_demo.png",
    n: int = 4000,
    eps: float = 5e-3,
    device: str = "cpu",
    backend: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Run the color-transfer demo and write a figure.

    Args:
        out: path of the PNG figure.
        n: pixels sampled from each picture for the OT problem.
        eps: entropic regularization (RGB units squared).
        device: torch device.
        backend: flashot backend.
        seed: sampling seed.
        progress: show the solver's progress line.

    Returns:
        A summary dict (sizes, cost, iterations, error, timings, figure path).
    """
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(seed)
    portrait, relief = _pictures()
    x = _sample(portrait, n, rng).to(device)
    y = _sample(relief, n, rng).to(device)
    t0 = time.perf_counter()
    res = flashot.sinkhorn(
        x,
        y,
        eps=eps,
        eps_schedule="geomloss",
        update="alternating",
        tol=1e-3,
        max_iter=2000,
        backend=backend,
        progress=progress,
    )
    t_solve = time.perf_counter() - t0
    t0 = time.perf_counter()
    pixels = torch.from_numpy(portrait.reshape(-1, 3).astype(np.float32)).to(device)
    recolored = res.plan.barycentric_map(pixels).clamp(0, 1).cpu().numpy().reshape(portrait.shape)
    t_map = time.perf_counter() - t0

    fig, axes = plt.subplots(
        1, 4, figsize=(17, 4.6), gridspec_kw=dict(width_ratios=[1, 1.17, 1, 1.3])
    )
    for ax, img, title in zip(
        axes[:3],
        (portrait, relief, recolored),
        (
            "source: Grace Hopper",
            "palette: Jacksboro fault relief",
            "source in the palette's colors",
        ),
        strict=True,
    ):
        ax.imshow(img)
        ax.set_title(title)
        ax.axis("off")
    ax = axes[3]
    bins = np.linspace(0, 1, 49)
    lum = np.array([0.299, 0.587, 0.114])
    for img, label, style in (
        (portrait, "source", dict(color="0.6", lw=2)),
        (relief, "palette", dict(color="tab:green", lw=2)),
        (recolored, "transported", dict(color="k", ls="--", lw=1.5)),
    ):
        hist, _ = np.histogram(img.reshape(-1, 3) @ lum, bins=bins, density=True)
        ax.plot(0.5 * (bins[1:] + bins[:-1]), hist, label=label, **style)
    ax.set_xlabel("luminance")
    ax.set_ylabel("density")
    ax.set_title("luminance histograms")
    ax.legend(frameon=False)
    fig.suptitle(
        f"flashot: entropic OT color transfer, {x.shape[0]} x {y.shape[0]} pixels, "
        f"eps={eps:g}, OT_eps={res.cost.item():.4f}, {res.n_iter} iterations, "
        f"{t_solve:.1f} s on {device}"
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return dict(
        n=x.shape[0],
        m=y.shape[0],
        eps=eps,
        cost=res.cost.item(),
        transport_cost=res.transport_cost.item(),
        n_iter=res.n_iter,
        marginal_error=res.marginal_error,
        converged=res.converged,
        solve_seconds=t_solve,
        map_seconds=t_map,
        mapped_pixels=pixels.shape[0],
        figure=str(out),
    )
