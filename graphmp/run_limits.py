"""Every ONNX Runtime run graphmp makes is bounded and stoppable.

A model from someone else can ask for work without end: a Loop with a constant trip count
of 10^12, a body that allocates each iteration, a run that never returns. graphmp bounds
what it can see before running and watches what it cannot:

- `check_trip_counts(model, path)`: a Loop whose trip count is a constant (an initializer
  or a Constant node) above MAX_LOOP_TRIPS, nested Loops counted as the product of their
  trip counts, is refused at load with one line naming the Loop node.
- `guarded(what, limits)(call)`: runs `call(run_options)` (an onnxruntime.RunOptions the
  call must pass to `run`/`run_with_iobinding`) under a time limit and a memory limit.
  A watchdog thread sets `run_options.terminate` when the run passes its deadline, when
  the process's resident memory passes the limit, or when SIGINT/SIGTERM arrives (it
  reads the signal from `signal.set_wakeup_fd`, which the C-level handler writes even
  while the main thread is inside ONNX Runtime, where a Python handler cannot run).
  ONNX Runtime checks the flag between nodes, so the run ends within a node's time.
  A limit hit raises RunLimitExceeded: one line saying which limit and how to raise it,
  never a different plan (it is a BaseException, so no `except Exception` that tries
  other input shapes or marks a benchmark row failed can turn it into a fallback). A
  signal raises what the signal's own Python handler raises (KeyboardInterrupt, the
  CLI's Terminated), so `finally` blocks clean up temporary files as for Ctrl-C.

Limits (RunLimits.for_model): time = BASE_SECONDS + 1 s per SECONDS_PER_BYTE bytes of the
model (a trivial model that cannot finish stops within about a minute); memory = 90% of
what the process holds plus what the machine has available when the run starts (it stops
before the machine's out-of-memory killer picks a process). GRAPHMP_RUN_SECONDS and
GRAPHMP_RUN_MEMORY_MB set either limit explicitly (0: no limit).
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from dataclasses import dataclass

from .errors import GraphmpError

MAX_LOOP_TRIPS = 10 ** 7      # iterations of one Loop, nested Loops multiplied
BASE_SECONDS = 60.0           # the time any run gets
SECONDS_PER_BYTE = 5e6        # plus 1 s per this many bytes of model (weights dominate a run's cost)
MIN_MEMORY = 1 << 30          # never a limit below 1 GiB
POLL_SECONDS = 0.05           # how often the watchdog looks at the clock and the resident memory
ENV_SECONDS, ENV_MEMORY = "GRAPHMP_RUN_SECONDS", "GRAPHMP_RUN_MEMORY_MB"


class RunLimitExceeded(BaseException):
    """A run passed its time or memory limit. Its message is one line for the user.
    A BaseException on purpose: code that catches Exception to try other shapes or to
    mark one benchmark row failed must not turn a limit into a different result."""


# --------------------------------------------------------------------------- limits
def _env_number(name: str) -> float | None:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise GraphmpError(f"{name}={text!r} is not a number; set it to a number (0: no limit)") from None
    if not value >= 0 or value == float("inf"):
        raise GraphmpError(f"{name}={text!r} must be a finite number >= 0 (0: no limit)")
    return value


def _available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """The process's resident memory now (/proc/self/statm), or None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class RunLimits:
    seconds: float | None          # None: no time limit
    memory_bytes: int | None       # None: no memory limit

    @staticmethod
    def for_model(model_bytes: int) -> "RunLimits":
        """The limits of one run of a model of `model_bytes` bytes (its file, or its
        serialized proto plus external data): see the module docstring."""
        seconds = _env_number(ENV_SECONDS)
        if seconds is None:
            seconds = BASE_SECONDS + max(0, model_bytes) / SECONDS_PER_BYTE
        memory = _env_number(ENV_MEMORY)
        if memory is None:
            rss, avail = resident_bytes(), _available_bytes()
            memory_bytes = None if rss is None or avail is None else max(MIN_MEMORY, int(0.9 * (rss + avail)))
        else:
            memory_bytes = int(memory * (1 << 20)) or None
        return RunLimits(seconds or None, memory_bytes)


def model_bytes(model) -> int:
    """The size a run's time limit is derived from: a ModelProto's serialized size plus its
    external data lengths, or a path's file size."""
    import onnx
    if isinstance(model, onnx.ModelProto):
        from .ir import iter_graphs
        external = 0
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                for e in t.external_data:
                    if e.key == "length" and e.value.isdigit():
                        external += int(e.value)
        return model.ByteSize() + external
    try:
        return os.path.getsize(os.fspath(model))
    except OSError:
        return 0


# --------------------------------------------------------------------------- trip counts
def _constant_ints(g, outer: dict) -> dict:
    """Tensor name -> int64 values of small integer constants visible in g (initializers
    and Constant nodes, with those of the enclosing graphs in `outer`)."""
    from onnx import numpy_helper
    found = dict(outer)
    tensors = [(t.name, t) for t in g.initializer]
    tensors += [(n.output[0], a.t) for n in g.node if n.op_type == "Constant" and n.output
                for a in n.attribute if a.name == "value" and a.HasField("t")]
    for name, t in tensors:
        if t.data_type in (6, 7) and len(t.dims) <= 1 and (not t.dims or t.dims[0] == 1) and not t.external_data:
            try:
                found[name] = int(numpy_helper.to_array(t).reshape(-1)[0])
            except (ValueError, IndexError, TypeError):
                continue
    return found


def check_trip_counts(model, path: str, limit: int = MAX_LOOP_TRIPS) -> None:
    """A GraphmpError naming the first Loop node (main graph or body) whose constant trip
    count, times those of the Loops around it, exceeds `limit`. Loops whose trip count is
    computed at run time are left to the run's time and memory limits."""
    from .ir import attr_graphs, iter_graphs
    from .names import shown
    if not any(n.op_type == "Loop" for g in iter_graphs(model.graph) for n in g.node):
        return  # the common case: no constants to read

    def walk(g, outer: dict, around: int, where: str):
        consts = _constant_ints(g, outer)
        for n in g.node:
            trips = around
            if n.op_type == "Loop" and n.domain in ("", "ai.onnx") and n.input and n.input[0]:
                m = consts.get(n.input[0])
                if m is not None:
                    trips = around * max(m, 0)
                    if trips > limit:
                        nested = f" ({around} iterations of the Loops around it times {m})" if around > 1 else ""
                        raise GraphmpError(
                            f"{path}: Loop node {shown(n.name or '(unnamed)')} in {where} has a constant trip count "
                            f"of {m}{nested}, more than graphmp runs ({limit}); the model would not finish. Give "
                            "a model whose loops end")
            for a in n.attribute:
                for sg in attr_graphs(a):
                    walk(sg, consts, trips, f"the body of {shown(n.name or n.op_type)}")
    walk(model.graph, {}, 1, "the main graph")


# --------------------------------------------------------------------------- the watchdog
class _Run:
    """One run the watchdog watches: its RunOptions, limits, deadline, and why it was stopped."""
    __slots__ = ("options", "limits", "deadline", "memory_bytes", "reason")

    def __init__(self, options, limits: RunLimits):
        self.options, self.limits, self.reason = options, limits, None
        self.deadline = None if limits.seconds is None else time.monotonic() + limits.seconds
        self.memory_bytes = limits.memory_bytes


class _Watchdog:
    """One daemon thread for the process: stops the registered runs (sets terminate) at
    their deadline, above their memory limit, or on a signal read from the wakeup pipe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs: set = set()
        self.wake_r = self.wake_w = None
        self.thread = None

    def _start(self):
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="graphmp-run-watchdog", daemon=True)
            self.thread.start()

    def listen_for_signals(self) -> None:
        """Have the C-level signal handler write to our pipe (main thread only, and only
        where no one else, such as asyncio, owns the wakeup fd)."""
        if self.wake_r is not None or threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return
        if old != -1:  # someone else listens: leave them their fd
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self.wake_r, self.wake_w = r, w

    def _drain(self) -> bool:
        """Empty the wakeup pipe; whether it held SIGINT or SIGTERM (each byte is the number
        of a signal that has a Python handler; other signals do not stop runs)."""
        got = False
        while self.wake_r is not None:
            try:
                chunk = os.read(self.wake_r, 64)
            except BlockingIOError:
                break
            if not chunk:
                break
            got = got or any(b in (signal.SIGINT, signal.SIGTERM) for b in chunk)
        return got

    def add(self, run: _Run):
        with self.lock:
            self._drain()  # a signal from before this run was handled by Python already
            self.runs.add(run)
            self._start()

    def remove(self, run: _Run):
        with self.lock:
            self.runs.discard(run)

    def _loop(self):
        while True:
            ready = []
            try:
                fds = [self.wake_r] if self.wake_r is not None else []
                ready = select.select(fds, [], [], POLL_SECONDS)[0] if fds else []
            except (OSError, ValueError):
                pass
            if not fds:
                time.sleep(POLL_SECONDS)
            with self.lock:
                signalled = bool(ready) and self._drain()
                runs = list(self.runs)
            if not runs:
                continue
            now = time.monotonic()
            rss = resident_bytes() if any(r.memory_bytes for r in runs) else None
            for r in runs:
                if signalled:
                    r.reason = r.reason or "signal"
                elif r.deadline is not None and now > r.deadline:
                    r.reason = r.reason or "time"
                elif r.memory_bytes and rss is not None and rss > r.memory_bytes:
                    r.reason = r.reason or "memory"
                if r.reason:
                    r.options.terminate = True


_WATCHDOG = _Watchdog()


def listen_for_signals() -> None:
    """Let SIGINT/SIGTERM stop a run inside ONNX Runtime (call from the main thread after
    installing the Python handlers; the CLI does)."""
    _WATCHDOG.listen_for_signals()


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


class guarded:
    """`guarded(what, size)(call)`: call(run_options) under the limits of a model of
    `size` bytes (RunLimits.for_model, taken at each call: the memory available changes),
    or under `limits` when given. `what` names the model in the error (escape model
    names first). Raises RunLimitExceeded when a limit stopped the run; a signal raises
    what its Python handler raises; anything else the run raises passes through."""

    def __init__(self, what: str, size: int = 0, limits: RunLimits | None = None):
        self.what, self.size, self.fixed = what, size, limits

    def __call__(self, call):
        import onnxruntime as ort
        options = ort.RunOptions()
        run = _Run(options, self.fixed or RunLimits.for_model(self.size))
        _WATCHDOG.add(run)
        try:
            return call(options)
        except Exception:
            if run.reason:
                self._stopped(run)
            raise
        finally:
            _WATCHDOG.remove(run)

    def _stopped(self, run: _Run):
        lim = run.limits
        if run.reason == "time":
            raise RunLimitExceeded(f"{self.what}: stopped after {lim.seconds:.0f} s, the time limit of one run; "
                                   f"the model may not finish. Set {ENV_SECONDS} to allow more (0: no "
                                   "limit)") from None
        if run.reason == "memory":
            raise RunLimitExceeded(f"{self.what}: stopped above {_size(lim.memory_bytes)} resident memory, the "
                                   f"memory limit of one run. Give smaller inputs (--shapes, smaller batches) or "
                                   f"set {ENV_MEMORY} (0: no limit)") from None
        # a signal: its Python handler raises at the next bytecode; if it has none that raises
        # (SIGINT ignored), say so rather than report ONNX Runtime's "terminate flag" error
        raise KeyboardInterrupt() from None
