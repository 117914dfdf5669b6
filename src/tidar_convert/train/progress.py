"""Progress a person can read: a bar on a terminal, a periodic log line when output goes to a file.

A tqdm bar redirected to a file is one line of carriage returns that says nothing until the job
ends; a SLURM log or `make convert > log` needs plain lines with the step, the rate and an ETA
instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator


def is_tty(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


def duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7.2 -> '7s'."""
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class LogLines:
    """Says `desc: done/total (pct) rate, ETA` at most every `interval` seconds, and at the end."""

    def __init__(
        self, desc: str, total: int | None, unit: str, interval: float = 30.0, stream=None
    ):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.stream = stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.done = 0

    def line(self, done: int, extra: str = "") -> str:
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {done}/{self.total}" if self.total else f"{self.desc}: {done}"]
        if self.total:
            parts[0] += f" ({100 * done / self.total:.0f}%)"
        parts.append(f"{rate:.2f} {self.unit}/s")
        if extra:
            parts.append(extra)
        if self.total and rate > 0:
            parts.append(
                f"ETA {duration((self.total - done) / rate)}"
                if done < self.total
                else f"took {duration(elapsed)}"
            )
        return ", ".join(parts)

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        self.done = done
        now = time.perf_counter()
        if force or now - self.last >= self.interval or (self.total and done >= self.total):
            self.last = now
            print(self.line(done, extra), file=self.stream, flush=True)


def progress(
    items: Iterable, desc: str, total: int | None = None, unit: str = "it", interval: float = 30.0
) -> Iterator:
    """`for x in progress(items, "bench")`: tqdm on a terminal, LogLines otherwise."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    if is_tty():
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=desc, total=total, unit=unit)
        return
    log = LogLines(desc, total, unit, interval)
    for i, item in enumerate(items, 1):
        yield item
        log.update(i)
