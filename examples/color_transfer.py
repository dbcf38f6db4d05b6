"""Color transfer: move one picture's colors onto another's palette by entropic OT.
================================================================================

The pixels of each picture are a cloud in RGB space. A Sinkhorn solve between samples
of both clouds gives an entropic map (``TransportPlan.barycentric_map`` at new points),
which recolors every pixel of the source. Prints the Sinkhorn divergence to the target
palette before and after, and writes the source, the target and the result side by side.
The pictures ship with matplotlib (no download).

    python examples/color_transfer.py --n 5000 --out color_transfer.png
"""

import argparse

import matplotlib
import numpy as np
import torch
from matplotlib import cbook
from matplotlib import image as mpimg

import flashot


def picture(name: str, side: int) -> np.ndarray:
    """A matplotlib sample picture as float RGB in [0, 1], about ``side`` pixels high."""
    with cbook.get_sample_data(name) as f:
        img = mpimg.imread(f)
    img = img[..., :3].astype(np.float32)
    if img.max() > 1.0:
        img /= 255.0
    step = max(1, img.shape[0] // side)
    return img[::step, ::step]


def main(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--source", default="grace_hopper.jpg")
    p.add_argument("--target", default="Minduka_Present_Blue_Pack.png")
    p.add_argument("--side", type=int, default=256, help="picture height after subsampling")
    p.add_argument("--n", type=int, default=5000, help="pixels sampled from each picture")
    p.add_argument("--blur", type=float, default=0.1, help="ε = blur² (colors in [0, 1])")
    p.add_argument("--out", default="color_transfer.png", help="the figure ('' for none)")
    args = p.parse_args(argv)
    src, tgt = picture(args.source, args.side), picture(args.target, args.side)
    x_all = torch.from_numpy(src.reshape(-1, 3).copy())
    y_all = torch.from_numpy(tgt.reshape(-1, 3).copy())
    gen = torch.Generator().manual_seed(0)
    x = x_all[torch.randperm(len(x_all), generator=gen)[: args.n]]
    y = y_all[torch.randperm(len(y_all), generator=gen)[: args.n]]
    # marginals to 1e-4 suffice for a picture (float32 rounding floors near 1e-5 here)
    kw = dict(eps=args.blur**2, cost="half_sqeuclidean", eps_schedule="geomloss", tol=1e-4,
              max_iter=5000)  # fmt: skip
    plan = flashot.sinkhorn(x, y, **kw).plan
    mapped = plan.barycentric_map(x_all).clamp(0.0, 1.0)
    before = float(flashot.sinkhorn_divergence(x, y, **kw))
    mapped_sample = mapped[torch.randperm(len(mapped), generator=gen)[: args.n]]
    after = float(flashot.sinkhorn_divergence(mapped_sample, y, **kw))
    print(f"Sinkhorn divergence to the target palette: before {before:.4f}, after {after:.4f}")
    if args.out:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(12, 4.4))
        shown = (src, tgt, mapped.reshape(src.shape).numpy())
        for ax, img, title in zip(axes, shown, ("source", "target palette", "recolored"),
                                  strict=True):  # fmt: skip
            ax.imshow(img)
            ax.set_title(title)
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)
        print(f"wrote {args.out}")
    return before, after


if __name__ == "__main__":
    main()
