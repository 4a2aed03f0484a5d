"""A small terminal progress bar (no dependencies): drawn on stderr when it is a TTY, or when asked."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{int(n)} B"


class Progress:
    """`advance(n, label)` adds `n` of `total` units; redraws at most every `interval` seconds."""

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None,
                 title: str = "building", interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total, self.done, self.title, self.interval = max(total, 1), 0, title, interval
        self._last = 0.0
        self._start = time.monotonic()

    def advance(self, n: int, label: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.interval or self.done >= self.total):
            self._last = now
            self._draw(label)

    def _draw(self, label: str) -> None:
        width = shutil.get_terminal_size((100, 20)).columns
        frac = min(self.done / self.total, 1.0)
        bar_w = 30
        filled = int(frac * bar_w)
        amount = f"{human_bytes(self.done)}/{human_bytes(self.total)}"
        line = (f"{self.title} [{'#' * filled}{'.' * (bar_w - filled)}] {frac * 100:5.1f}% {amount} "
                f"{time.monotonic() - self._start:5.1f}s {label}")
        self.stream.write("\r" + line[:max(width - 1, 20)].ljust(max(width - 1, 20)))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
