"""Progress of long operations, readable where it lands.

On a terminal: one bar redrawn in place (``\\r``, at most every 0.2 s). Anywhere else (a file, a CI or
cluster job log, the ``fsdp_plugin`` logger): a few whole lines, at the start, at every 10% and at the end,
each with the amount done, the total and the rate, since a log shows every ``\\r`` redraw as one long line.

``Progress(label)(done, total)`` is the callback the checkpoint tools take; :func:`logged` makes one that
writes to the ``fsdp_plugin`` logger (INFO) for library operations (``load_pretrained``, ``fp.shard``), only
when the work is large enough to be worth a line. Thread-safe: readers call it from several threads.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

#: library operations below this many bytes log no progress (they take well under a second)
LOG_MIN_BYTES = 1 << 30


class Progress:
    """``__call__(done, total)``: ``done`` of ``total`` (bytes, or items when ``unit`` is given) finished.

    ``write``: where whole lines go (default: ``stream``, stderr); a bar is drawn only when ``write`` is not
    given and ``stream`` is a terminal."""

    def __init__(self, label: str, stream=None, unit: Optional[str] = None,
                 write: Optional[Callable[[str], None]] = None):
        self.label, self.unit = label, unit
        self.stream = stream or sys.stderr
        self.bar = write is None and _isatty(self.stream)
        self.write = write or self._write_line
        self.t0, self.last, self.tenths = time.monotonic(), 0.0, -1
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            if self.bar:
                self._draw(done, total)
            else:
                self._line(done, total)

    def _line(self, done: int, total: int) -> None:
        if self.tenths < 0:
            self.tenths = 0
            self.write(f"{self.label}: started, {self._amount(0, total)}")
        tenths = 10 if total <= 0 or done >= total else int(10 * done / total)
        if tenths > self.tenths:
            self.tenths = tenths
            what = "done" if tenths == 10 else f"{10 * tenths}%"
            self.write(f"{self.label}: {what}, {self._amount(done, total)}{self._rate(done)}")

    def _draw(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.2 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        amount = f"{self._amount(done, total)}{self._rate(done)}"
        self.stream.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {amount}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()

    def _amount(self, done: int, total: int) -> str:
        if self.unit:
            return f"{done:,}/{total:,} {self.unit}"
        return f"{_size(done)}/{_size(total)}"

    def _rate(self, done: int) -> str:
        dt = time.monotonic() - self.t0
        if done <= 0 or dt <= 0:
            return ""
        if self.unit:  # counted items (measurements, units): the elapsed time says enough
            return f", {dt:.1f} s"
        return f", {_size(done / dt)}/s, {dt:.1f} s"

    def _write_line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def logged(label: str, total_bytes: int, unit: Optional[str] = None) -> Optional[Progress]:
    """A :class:`Progress` writing lines to the ``fsdp_plugin`` logger at INFO, or None when INFO is off or
    the operation moves fewer than :data:`LOG_MIN_BYTES` (nothing worth reporting)."""
    import logging

    from ._log import logger

    if total_bytes < LOG_MIN_BYTES or not logger.isEnabledFor(logging.INFO):
        return None
    return Progress(label, unit=unit, write=logger.info)


def _size(nbytes: float) -> str:
    """Bytes in decimal units (B, kB, MB, GB), one decimal place: the units ``ls -h --si`` and disks use."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
