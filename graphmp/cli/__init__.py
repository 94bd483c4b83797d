"""The `graphmp` command: a thin layer over the Python API (convert, check, pad, inspect,
train, build, bench).

One module per subcommand (or family): each has `add(sub)`, which builds its subparser,
and `run(args)`, which calls the API and returns the exit code; `args` holds the options
several commands share, `outputs` the checks and writes around their files. `main`
parses, dispatches and turns errors, Ctrl-C and SIGTERM into one line and an exit code.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import shlex
import signal
import sys
import threading

from ..errors import GraphmpError
from ..progress import DEBUG, NORMAL, QUIET, native_stdout_to_stderr, set_verbosity
from ..version import __version__
from . import bench, build, check, convert, inspect, pad, train
from .help import HelpFormatter, use_help_style

# One entry per subcommand: name -> (add its parser, run it).
COMMANDS = {
    "convert": (convert.add, convert.run),
    "check": (check.add, check.run),
    "pad": (pad.add, pad.run),
    "inspect": (inspect.add, inspect.run),
    "train-graph": (train.add_train_graph, train.run_train_graph),
    "train": (train.add_train, train.run_train),
    "export": (train.add_export, train.run_export),
    "build": (build.add, build.run),
    "bench": (bench.add, bench.run),
}


EPILOG = """\
every command takes -q (errors only) and -v / -vv (steps and timings / per-node decisions
on stderr); `graphmp COMMAND --help` shows its options with their defaults.

examples:
  # from a clone of the repository
  graphmp convert models/tiny/resnet.onnx -o /tmp/resnet.mp.onnx
  graphmp check models/tiny/resnet.onnx /tmp/resnet.mp.onnx
  python -m graphmp convert models/tiny/resnet.onnx -o /tmp/resnet.mp.onnx -v
"""


def _parser():
    p = argparse.ArgumentParser(prog="graphmp", description="Make FP32 ONNX models fast on Tensor Cores "
                                "without losing accuracy.", epilog=EPILOG, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"graphmp {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    for command in sub.choices.values():  # one help style everywhere: defaults shown, examples kept as written
        use_help_style(command)
    return p


def _set_verbosity(args) -> int:
    """The level of -q / -v / -vv for graphmp.progress (returned)."""
    level = QUIET if getattr(args, "quiet", False) else NORMAL + getattr(args, "verbose", 0)
    set_verbosity(level)
    return level


def _runtime_log(level: int) -> None:
    """ONNX Runtime's own log to match the level: its warnings (initializers it removes, nodes
    it places) only with -vv. A Ctrl-C while onnxruntime imports surfaces as an ImportError
    ('import numpy failed'): that is the interrupt, not a missing package."""
    try:
        with _signals_held():
            import onnxruntime
        onnxruntime.set_default_logger_severity(2 if level >= DEBUG else 3)
    except ImportError:  # graphmp's own check says so where a command needs it
        if _INTERRUPTED["sigint"]:
            raise KeyboardInterrupt from None


@contextlib.contextmanager
def _signals_held():
    """SIGINT/SIGTERM held back while the block runs (delivered when it ends): a Ctrl-C inside
    onnxruntime's import of numpy is printed by its C code as a traceback and turned into an
    ImportError; held, it arrives after the import as an ordinary KeyboardInterrupt."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


_INTERRUPTED = {"sigint": False}


def _on_sigint(signum, frame):
    """Python's own behaviour (KeyboardInterrupt), and a note that it happened: an import that
    a Ctrl-C breaks reports an ImportError, which must still end the command."""
    _INTERRUPTED["sigint"] = True
    raise KeyboardInterrupt


def _native_output(args):
    """What C/C++ libraries print to stdout goes to stderr with -v, nowhere otherwise (onnx's
    warnings repeat what the summary says); not around `train`, whose --nproc launcher hands
    its stdout to the ranks it starts."""
    if args.cmd == "train":
        return contextlib.nullcontext()
    return native_stdout_to_stderr(shown=getattr(args, "verbose", 0) > 0)


def _one_line(text: str) -> str:
    """An error as one printable line: names from a model (tensor, node, location) may hold
    newlines, NULs or terminal escapes, which must not forge lines or reach the terminal."""
    from ..names import one_line
    return one_line(text)


class Terminated(BaseException):
    """SIGTERM, raised where Python code runs so that temporary files are cleaned up
    (by the same `finally`/`except` paths as Ctrl-C)."""


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    args.command_line = shlex.join(["graphmp", *(sys.argv[1:] if argv is None else argv)])  # recorded by bench
    if args.cmd is None:
        _parser().print_help()
        return 2
    args.level = _set_verbosity(args)
    try:
        with _native_output(args):
            rc = _run(args)
            sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return rc
    except Terminated:  # a SIGTERM while the command's own ending ran (torchrun stopping a rank that
        return 143      # has already said its error): the exit code says so, no traceback
    except BrokenPipeError:
        return _pipe_closed()
    except OSError as e:
        if e.errno not in STDOUT_FULL:
            raise
        _stdout_to_devnull()  # so that the flush at exit fails no more
        print(f"graphmp: error: the result could not be written to stdout ({e.strerror}); free space on "
              "the device it goes to, or send it elsewhere", file=sys.stderr)
        return 2
    finally:
        set_verbosity(None)  # a library call after main() (in the same process) is not a command


# errors writing the result to stdout that are the device's, not graphmp's (`> /dev/full`, a full disk or quota)
STDOUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _pipe_closed() -> int:
    """stdout's reader went away (`graphmp check A B | head -c 10`): end quietly, with the
    exit code of a SIGPIPE (128 + 13)."""
    _stdout_to_devnull()
    return 141


def _stdout_to_devnull() -> None:
    """stdout now points to /dev/null, so the interpreter's flush at exit says nothing."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _run(args) -> int:
    """The command, with SIGTERM raised as Terminated; errors as one line and an exit code.
    SIGINT and SIGTERM also stop a run inside ONNX Runtime (graphmp.run_limits reads them
    from the signal wakeup fd, since the Python handler waits for ONNX Runtime to return)."""
    from ..run_limits import RunLimitExceeded, listen_for_signals
    previous = previous_int = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where a caller set its own
            previous_int = signal.signal(signal.SIGINT, _on_sigint)
        listen_for_signals()
    try:
        _runtime_log(getattr(args, "level", NORMAL))
        return COMMANDS[args.cmd][1](args)
    except (GraphmpError, RunLimitExceeded) as e:
        print(f"graphmp: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # stdout closed: main ends quietly (a write to stderr could fail the same way)
    except KeyboardInterrupt:
        print("graphmp: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print("graphmp: terminated; nothing was written", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)

