"""Progress output, decided in one place: a bar on a terminal, plain lines in a file or a pipe.

Every loop that shows progress calls `progress_bar(...)` (the same arguments as a tqdm bar). When standard
error is a terminal it is a tqdm bar, redrawn in place. When it is a file or a pipe (a log, `| tee`, CI,
a test capturing output), a redrawn bar would write hundreds of `\\r` frames into the log, so the same calls
print plain lines instead, as timm's and Lightning's loggers do: one line every `every` steps (the
training loop passes train.log_interval), one at least every PLAIN_SECONDS while a loop runs, and a last one
when a loop ends, e.g. once per epoch or per evaluated set (not for a transient one, such as validation inside
training). A terminal that reports fewer than MIN_COLUMNS columns (0, in some containers and CI terminals)
gets the plain lines too: tqdm would draw nothing there. `enabled=False` shows nothing either way.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

PLAIN_SECONDS = 60.0  # in a file or a pipe: at least one line this often while a loop runs
MIN_COLUMNS = 20  # a terminal narrower than this (some report 0 columns) gets plain lines: a bar would not show


def on_terminal(stream=None) -> bool:
    """Whether `stream` (standard error by default, where bars are drawn) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def terminal_columns(stream=None) -> int:
    """The width of the terminal `stream` (standard error by default) is drawn on; 0 where it reports none."""
    stream = sys.stderr if stream is None else stream
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def progress_bar(iterable=None, *, desc: str = "", total: int | None = None, unit: str = "it", enabled: bool = True,
                 leave: bool = True, transient: bool = False, initial: int = 0, every: int = 0):
    """A progress display over `iterable` (or updated by hand with `update(n)`); see the module docstring. `leave`
    False: the bar is cleared from a terminal when done (a file or a pipe still gets its last line); `transient`: a
    loop inside another's (validation inside training) that leaves nothing behind anywhere."""
    if not enabled:
        return tqdm(iterable, total=total, disable=True)
    if on_terminal() and terminal_columns() >= MIN_COLUMNS:
        return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave and not transient, initial=initial,
                    dynamic_ncols=True)
    return PlainProgress(iterable, desc=desc, total=total, unit=unit, leave=not transient, initial=initial, every=every)


def write(line: str) -> None:
    """Print a line without breaking a bar being drawn (tqdm.write on a terminal)."""
    if on_terminal():
        tqdm.write(line)
    else:
        print(line, flush=True)


class PlainProgress:
    """The plain-line twin of a tqdm bar: iterate, update, set_postfix, set_postfix_str, close, `with`."""

    def __init__(self, iterable=None, *, desc="", total=None, unit="it", leave=True, initial=0, every=0, stream=None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.desc, self.total, self.unit, self.leave, self.every = iterable, desc, total, unit, leave, every
        self.stream = stream
        self.n = self.printed_at = self.started_at = initial
        self.started = self.last_line = time.perf_counter()
        self.postfix = ""
        self.closed = False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return self.total if self.total is not None else len(self.iterable)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        due = (self.every and self.n % self.every == 0) or now - self.last_line >= PLAIN_SECONDS
        if due and self.n != self.printed_at:
            self.print_line(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str = "") -> None:
        self.postfix = text

    def close(self) -> None:
        if not self.closed and self.leave and self.n != self.printed_at:
            self.print_line(time.perf_counter())
        self.closed = True

    def print_line(self, now: float) -> None:
        seconds = now - self.started
        done = self.n - self.started_at
        rate = f", {done / seconds:.3g} {self.unit}/s" if seconds > 0 and done else ""
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        line = f"{self.desc + ': ' if self.desc else ''}{count} {self.unit} [{seconds:.1f} s{rate}]"
        print(line + (f" {self.postfix}" if self.postfix else ""), file=self.stream or sys.stderr, flush=True)
        self.printed_at, self.last_line = self.n, now
