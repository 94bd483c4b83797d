"""A small progress line for long work (engine builds, training epochs).

Writes to stderr, redraws in place on a terminal and prints a line per update
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

import sys
import time


class Progress:
    def __init__(self, total: int | None = None, desc: str = "", stream=None, enabled: bool = True,
                 min_interval: float = 0.1, log_interval: float = 10.0, status_interval: float = 2.0):
        self.total, self.desc, self.n = total, desc, 0
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
        if self.enabled:
            if self.tty:
                self._draw("\n")
            elif self._drawn != (self.n, self.fields):
                self._draw()
            self.enabled = False
