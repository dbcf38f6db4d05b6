"""The solver's progress line on stderr (``sinkhorn(progress=True)``)."""

from __future__ import annotations

import math
import sys
import time

__all__ = ["Progress"]


class Progress:
    """Progress on stderr: a tqdm bar (rate, ETA) when tqdm is installed, else one line.

    The line is redrawn in place on a terminal (a line every few seconds in a log) and
    gives the time left to ``max_iter`` (a tolerance may end the solve sooner).
    """

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.t0, self.last = enabled, total, time.perf_counter(), 0.0
        self.bar = _tqdm_bar(total) if enabled else None
        self.tty = enabled and sys.stderr.isatty()
        self.every = 0.2 if self.tty else 5.0

    def update(self, it: int, eps: float, error: float | None, force: bool = False):
        """Show iteration ``it`` (at most every few seconds unless ``force``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        err = "" if error is None or math.isnan(error) else f" err {error:.2e}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"eps {eps:.3g}{err}", refresh=False)
            self.bar.update(it - self.bar.n)
            return
        elapsed = now - self.t0
        eta = elapsed / it * (self.total - it) if it else float("nan")
        bar = "#" * int(30 * it / self.total)
        line = (f"sinkhorn [{bar:<30}] {it}/{self.total} eps {eps:.3g}{err} "
                f"{elapsed:.1f}s, at most {eta:.1f}s left")  # fmt: skip
        # \x1b[K clears what a longer previous line left on a terminal
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else (line + "\n"))
        sys.stderr.flush()

    def close(self, done: int | None = None):
        """End the line (or the bar).

        ``done``: the iterations run, when a tolerance ended the solve before
        ``max_iter`` (the total then shows the work done, not the cap).
        """
        if done is not None and self.enabled and done < self.total:
            self.total = done
            if self.bar is not None:
                self.bar.total = done
                self.bar.refresh()
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _tqdm_bar(total: int):
    """A tqdm bar on stderr, or None without tqdm (an optional dependency)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="sinkhorn", unit="it", file=sys.stderr, dynamic_ncols=True)
