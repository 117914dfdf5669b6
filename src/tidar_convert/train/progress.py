"""Progress a person can read: a bar on a terminal, a periodic log line when output goes to a file.

A tqdm bar redirected to a file is one line of carriage returns that says nothing until the job
ends; a SLURM log or `make convert > log` needs plain lines with the step, the rate and an ETA
instead. `Bar` is tqdm that does both, and the libraries' own bars are made Bars (`install`:
transformers' weight loading and saving; `Bar` is huggingface_hub's `tqdm_class` for downloads).
tqdm's own variables set when a bar starts and how often a log line comes: TQDM_DELAY (seconds a
step runs before it shows anything, default DELAY) and TQDM_MININTERVAL (seconds between log
lines, default LOG_INTERVAL).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from tqdm.auto import tqdm

# a step shorter than this shows nothing: loading a small model's weights is no news
DELAY = 5.0
LOG_INTERVAL = 30.0


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
        self,
        desc: str,
        total: int | None,
        unit: str,
        interval: float = LOG_INTERVAL,
        stream=None,
        amount: Callable[[float], str] = str,
    ):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.stream = stream or sys.stderr
        self.amount = amount  # how a count reads: 3 prompts, 1.20G bytes
        self.start = self.last = time.perf_counter()
        self.done = 0

    def line(self, done: int, extra: str = "") -> str:
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        n, total = self.amount(done), self.total and self.amount(self.total)
        parts = [f"{self.desc}: {n}/{total}" if self.total else f"{self.desc}: {n}"]
        if self.total:
            parts[0] += f" ({100 * done / self.total:.0f}%)"
        if done and self.amount is str:
            parts.append(f"{rate:.2f} {self.unit}/s")
        elif done:
            parts.append(f"{self.amount(rate)}{self.unit}/s")
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


def _setting(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class _Nowhere:
    """Where a Bar in a log file sends tqdm's redraws (carriage returns, cursor moves)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class Bar(tqdm):
    """tqdm that reads well in a log file too. On a terminal it is tqdm's bar; elsewhere LogLines'
    line (`desc: done/total (pct), rate, ETA`), the first once the step has run `delay` seconds,
    then at most every `interval`, and one at the end, with no carriage return. A step that ends
    within `delay` shows nothing on either."""

    def __init__(self, *args, interval: float | None = None, **kwargs):
        stream = kwargs.get("file") or sys.stderr
        kwargs.setdefault("delay", _setting("TQDM_DELAY", DELAY))
        self._log: LogLines | None = None
        self._closing, self._said = False, None
        if not is_tty(stream):
            every = _setting("TQDM_MININTERVAL", LOG_INTERVAL) if interval is None else interval
            scaled = kwargs.get("unit_scale") and kwargs.get("unit_divisor", 1000)
            self._log = LogLines(
                str(kwargs.get("desc") or ""),
                None,
                kwargs.get("unit", "it"),
                every,
                stream,
                (lambda x: tqdm.format_sizeof(x, divisor=scaled)) if scaled else str,
            )
            kwargs["file"] = _Nowhere()
            kwargs["mininterval"] = min(every, 1.0)  # how often display() is asked
            if kwargs.get("disable") is None:  # tqdm's "no terminal, no bar": here, lines
                kwargs["disable"] = False
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None):
        if self._log is None:
            return super().display(msg, pos)
        log, now = self._log, time.perf_counter()
        if self._closing:  # the end, unless the last line said it already
            due = self._said is None or self.n != self._said[1]
        else:
            due = self._said is None or now - self._said[0] >= log.interval
        if due:
            self._said = (now, self.n)
            log.desc, log.total = self.desc, self.total
            log.start = now - self.format_dict["elapsed"]
            print(log.line(int(self.n)), file=log.stream, flush=True)
        return True

    def close(self):
        self._closing = True
        super().close()


def install() -> None:
    """transformers' own bars (loading and saving weights) are Bars, through its tqdm hook; where
    its progress bars are turned off they stay off."""
    from transformers.utils import logging

    set_hook = getattr(logging, "set_tqdm_hook", None)  # transformers >= 5.x
    if set_hook is not None:
        set_hook(
            lambda factory, args, kwargs: (Bar if factory is tqdm else factory)(*args, **kwargs)
        )


def hub_download_kwargs() -> dict:
    """from_pretrained's `tqdm_class` for the hub's download bars, where this transformers takes it:
    huggingface_hub's own bars say nothing when output is not a terminal."""
    try:
        from transformers.utils.hub import DownloadKwargs
    except ImportError:
        return {}
    return {"tqdm_class": Bar} if "tqdm_class" in DownloadKwargs.__annotations__ else {}


def progress(
    items: Iterable,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    interval: float | None = None,
    delay: float | None = None,
) -> Iterator:
    """`for x in progress(items, "bench")`: a Bar over the items."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    kwargs = {} if delay is None else {"delay": delay}
    yield from Bar(items, desc=desc, total=total, unit=unit, interval=interval, **kwargs)
