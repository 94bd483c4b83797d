"""How much graphmp says, and a small progress line for long work (calibration, island
trials, the search, benchmark rounds, training epochs).

Verbosity: every command's -q / -v / -vv sets one level here (`set_verbosity`), which the
code that prints reads (`verbosity`, `shows_progress`): QUIET prints errors only; NORMAL
the result (a summary, a table) and real warnings, each once; VERBOSE adds the steps and
their timings; DEBUG the per-node decisions. Progress lines go to stderr, by default only
when stderr is a terminal (a log file or pipe gets them with -v). A library caller who
sets nothing gets no progress line unless it asks (`convert(verbose=True)`,
`train(progress=True)`).

The progress line writes to stderr, redraws in place on a terminal and prints a line per update
(throttled) when stderr is a file or pipe, so CI logs stay readable.

    with Progress(total=n, desc="epoch 1") as p:
        for batch in batches:
            ...
            p.update(1, loss=f"{loss:.4f}", scale=int(scale))

Work inside one step (a benchmark row's warm-up and timed runs) reports with `status`,
at most every `status_interval` seconds:

    p.status(lambda: f"  fp16 batch 8: run {i}/50, {t:.1f} s")
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import time

QUIET, NORMAL, VERBOSE, DEBUG = -1, 0, 1, 2
# the seconds a phase runs before its progress line appears: short phases say nothing
PROGRESS_DELAY_S = 3.0

_verbosity: int | None = None  # None: not set by a command (a library caller)


def set_verbosity(level: int | None) -> None:
    """The level of this process (QUIET .. DEBUG; higher values count as DEBUG); None
    forgets it (a library caller's default). The CLI sets it at the start of every command."""
    global _verbosity
    _verbosity = None if level is None else max(QUIET, min(DEBUG, int(level)))


def verbosity() -> int:
    """The level set by the command (NORMAL where none was set)."""
    return NORMAL if _verbosity is None else _verbosity


def shows_progress(stream=None) -> bool:
    """Whether long work draws progress lines on `stream` (default stderr): with -v, or at
    the default level when the stream is a terminal; never with -q, nor for a library
    caller who set no level."""
    if _verbosity is None or _verbosity <= QUIET:
        return False
    if _verbosity >= VERBOSE:
        return True
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def says_results() -> bool:
    """Whether a command prints results as they come (a data-parallel run's eval per epoch):
    at the default level or above; not with -q, nor for a library caller who set no level."""
    return _verbosity is not None and _verbosity >= NORMAL


@contextlib.contextmanager
def native_stdout_to_stderr(shown: bool = True):
    """While the block runs, what C/C++ libraries (onnx's checker and shape inference: "Warning:
    Model contains experimental ops", which the summary says again) write straight to file
    descriptor 1 goes to stderr, or nowhere when not `shown`: stdout holds graphmp's result
    (a summary or table that scripts read). Python's sys.stdout keeps writing to the real
    stdout. Does nothing where sys.stdout is not file descriptor 1 (a test's capture, an
    embedding application)."""
    try:
        redirect = sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        redirect = False
    if not redirect:
        yield
        return
    python_stdout = sys.stdout
    python_stdout.flush()
    real = os.dup(1)
    if shown:
        os.dup2(2, 1)
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    sys.stdout = io.TextIOWrapper(os.fdopen(real, "wb", closefd=False),
                                  encoding=getattr(python_stdout, "encoding", None) or "utf-8",
                                  errors=getattr(python_stdout, "errors", None),
                                  line_buffering=getattr(python_stdout, "line_buffering", False))
    try:
        yield
    finally:
        try:
            sys.stdout.flush()  # a closed pipe or full device raises here: the caller says so, stdout restored first
        except OSError:
            if sys.exc_info()[1] is None or sys.exc_info()[1].__context__ is None:
                raise  # the block itself ended normally: this is the error to report
        finally:
            sys.stdout = python_stdout
            os.dup2(real, 1)
            os.close(real)


class Progress:
    """delay: seconds before the first line is drawn; a phase that ends sooner prints nothing."""

    def __init__(self, total: int | None = None, desc: str = "", stream=None, enabled: bool = True,
                 min_interval: float = 0.1, log_interval: float = 10.0, status_interval: float = 2.0,
                 delay: float = 0.0):
        self.total, self.desc, self.n = total, desc, 0
        self.delay = delay
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval = min_interval if self.tty else log_interval
        self.t0 = time.perf_counter()
        self._last = 0.0
        self.status_interval = status_interval
        self._status_last = self.t0  # the first status line comes status_interval after the start
        self._drawn = None          # (n, fields) of the last line drawn
        self.fields: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _line(self) -> str:
        el = time.perf_counter() - self.t0
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            w = 24
            done = int(w * min(self.n, self.total) / self.total)
            head += f"[{'#' * done}{'.' * (w - done)}] {self.n}/{self.total}"
        else:
            head += f"{self.n}"
        rate = self.n / el if el > 0 else 0.0
        tail = "".join(f" {k}={v}" for k, v in self.fields.items())
        return f"{head} {el:.1f}s ({rate:.1f}/s){tail}"

    def update(self, n: int = 1, **fields):
        self.n += n
        self.fields.update(fields)
        now = time.perf_counter()
        if self.enabled and now - self.t0 < self.delay:
            return
        if self.enabled and (now - self._last >= self.min_interval or (self.total and self.n >= self.total)):
            self._last = now
            self._draw()

    def status(self, text):
        """Say how the current step is going (`text`: a line, or a function returning it, called
        only when the line is drawn), at most every `status_interval` seconds. On a terminal it
        is drawn over the bar's line (the bar's next update draws over it again); to a file or
        pipe it is a line of its own. Nothing when disabled."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._status_last < self.status_interval:
            return
        self._status_last = now
        line = text() if callable(text) else text
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _draw(self, end: str = ""):
        self._drawn = (self.n, dict(self.fields))
        if self.tty:
            self.stream.write("\r" + self._line() + "\x1b[K" + end)
        else:
            self.stream.write(self._line() + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.delay and self._drawn is None:  # ended before its delay: nothing to close
            self.enabled = False
        if self.enabled:
            if self.tty:
                self._draw("\n")
            elif self._drawn != (self.n, self.fields):
                self._draw()
            self.enabled = False
