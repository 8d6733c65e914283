"""Progress of a batch job: a bar on a terminal (tqdm, when installed), plain log lines otherwise.

Both show records done out of the total, tokens, embeddings/s and the time left; the rate counts
this run only, so a resumed job's ETA is not skewed by the parts it found done.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """Thread-safe: the writer thread (or the Ray driver) updates, any thread may log."""

    def __init__(self, total_records: int, done_records: int, *, mode: str = "auto", log: Callable[[str], None] | None = None,
                 stream: TextIO | None = None, interval_s: float = 5.0):
        """mode: "auto" (a bar on `stream` if it is a terminal, else lines to `log`), "bar", "log"
        or "off" (messages only)."""
        self.stream = stream or sys.stderr
        self._log = log or (lambda m: print(m, file=self.stream, flush=True))
        self.total, self.done, self.done_at_start = total_records, done_records, done_records
        self.rows = self.tokens = 0  # this run
        self.start = self.last_log = time.perf_counter()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._bar = None
        self.quiet = mode == "off"
        if mode == "bar" or (mode == "auto" and self.stream.isatty()):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_records, initial=done_records, unit="rec", file=self.stream, dynamic_ncols=True, smoothing=0.1)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def update(self, records: int, rows: int, tokens: int) -> None:
        with self._lock:
            self.done += records
            self.rows += rows
            self.tokens += tokens
            rate = self.rows / max(self.elapsed_s, 1e-9)
            if self._bar is not None:
                self._bar.set_postfix_str(f"{_count(self.tokens)} tokens, {rate:.1f} emb/s", refresh=False)
                self._bar.update(records)
            elif not self.quiet and (time.perf_counter() - self.last_log >= self.interval_s or self.done == self.total):
                self.last_log = time.perf_counter()
                self._write(self._line(rate))

    def _line(self, rate: float) -> str:
        records_rate = (self.done - self.done_at_start) / max(self.elapsed_s, 1e-9)
        left = self.total - self.done
        eta = _duration(left / records_rate) if records_rate > 0 else "?"
        pct = 100.0 * self.done / max(self.total, 1)
        return f"{self.done}/{self.total} records ({pct:.1f}%), {_count(self.tokens)} tokens, {rate:.1f} emb/s, ETA {eta}"

    def log(self, message: str) -> None:
        with self._lock:
            self._write(message)

    def _write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            self._log(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
