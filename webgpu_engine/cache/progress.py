"""Progress of one fetch over many artifacts: a terminal bar (tqdm, only on a TTY) and the
`progress(fraction, text)` callback that the engine turns into WebLLM-style init-progress reports.

Reports are monotonic (a total that grows when a server announces a size never moves the fraction
back), throttled, and the last one is exactly 1.0.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

ProgressFn = Callable[[float, str], None]

_NOMINAL = 1 << 20          # weight of an artifact whose size nobody has told us yet


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class Progress:
    def __init__(self, callback: ProgressFn | None, sizes: dict[str, int | None], *,
                 bar: bool | None = None, min_interval: float = 0.1):
        self.callback = callback
        self.sizes = {k: (v if v else None) for k, v in sizes.items()}
        self.done: dict[str, int] = {k: 0 for k in sizes}
        self.last_fraction = 0.0
        self.last_time = 0.0
        self.min_interval = min_interval
        self.start = time.monotonic()
        self._bar = None
        if bar is not False and sizes:
            try:
                from tqdm import tqdm
                # disable=None: tqdm shows itself only when stderr is a terminal.
                self._bar = tqdm(total=self._total(), unit="B", unit_scale=True, leave=False,
                                 disable=None if bar is None else not bar, file=sys.stderr,
                                 desc="artifacts")
            except ImportError:      # tqdm is optional (not in Pyodide)
                self._bar = None

    def _total(self) -> int:
        return sum(v if v else _NOMINAL for v in self.sizes.values()) or 1

    def set_size(self, key: str, size: int | None) -> None:
        if size and not self.sizes.get(key):
            self.sizes[key] = size
            if self._bar is not None:
                self._bar.total = self._total()
                self._bar.refresh()

    def set_done(self, key: str, nbytes: int, text: str, force: bool = False) -> None:
        """Artifact `key` has `nbytes` (e.g. after a restart without Range support, or when cached)."""
        delta = nbytes - self.done.get(key, 0)
        self.done[key] = nbytes
        if self._bar is not None and delta:
            self._bar.update(delta)
        self._emit(text, force=force)

    def complete(self, key: str, text: str, emit: bool = True) -> None:
        size = self.sizes.get(key) or self.done.get(key) or _NOMINAL
        self.sizes[key] = size
        if emit:
            self.set_done(key, size, text, force=True)
            return
        delta, self.done[key] = size - self.done.get(key, 0), size
        if self._bar is not None and delta:
            self._bar.update(delta)

    def note(self, text: str) -> None:
        """A phase change without bytes (waiting for a lock, running pip, verifying)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text[:60])
        self._emit(text, force=True)

    def _fraction(self) -> float:
        total = self._total()
        got = sum(min(self.done.get(k, 0), v if v else _NOMINAL) for k, v in self.sizes.items())
        return min(got / total, 0.999)     # 1.0 is reserved for finish()

    def _emit(self, text: str, force: bool = False) -> None:
        frac = max(self._fraction(), self.last_fraction)
        now = time.monotonic()
        if not force and now - self.last_time < self.min_interval and frac - self.last_fraction < 0.01:
            return
        self.last_fraction, self.last_time = frac, now
        if self.callback is not None:
            self.callback(frac, text)

    def finish(self, text: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.last_fraction = 1.0
        if self.callback is not None:
            self.callback(1.0, text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start
