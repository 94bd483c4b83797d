"""The `graphmp` command: a thin layer over the Python API (convert, check, pad, train,
build, bench).

One module per subcommand (or family): each has `add(sub)`, which builds its subparser,
and `run(args)`, which calls the API and returns the exit code; `args` holds the options
several commands share, `outputs` the checks and writes around their files. `main`
parses, dispatches and turns errors, Ctrl-C and SIGTERM into one line and an exit code.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading

from ..errors import GraphmpError
from ..version import __version__
from . import bench, build, check, convert, pad, train

# One entry per subcommand: name -> (add its parser, run it).
COMMANDS = {
    "convert": (convert.add, convert.run),
    "check": (check.add, check.run),
    "pad": (pad.add, pad.run),
    "train-graph": (train.add_train_graph, train.run_train_graph),
    "train": (train.add_train, train.run_train),
    "export": (train.add_export, train.run_export),
    "build": (build.add, build.run),
    "bench": (bench.add, bench.run),
}


def _parser():
    p = argparse.ArgumentParser(prog="graphmp", description="Make FP32 ONNX models fast on Tensor Cores "
                                "without losing accuracy.")
    p.add_argument("--version", action="version", version=f"graphmp {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for add, _ in COMMANDS.values():
        add(sub)
    return p


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
    try:
        rc = _run(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return rc
    except Terminated:  # a SIGTERM while the command's own ending ran (torchrun stopping a rank that
        return 143      # has already said its error): the exit code says so, no traceback
    except BrokenPipeError:
        return _pipe_closed()


def _pipe_closed() -> int:
    """stdout's reader went away (`graphmp check A B | head -c 10`): end quietly, with the
    exit code of a SIGPIPE (128 + 13). stdout now points to /dev/null, so the flush at exit
    says nothing either."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def _run(args) -> int:
    """The command, with SIGTERM raised as Terminated; errors as one line and an exit code.
    SIGINT and SIGTERM also stop a run inside ONNX Runtime (graphmp.run_limits reads them
    from the signal wakeup fd, since the Python handler waits for ONNX Runtime to return)."""
    from ..run_limits import RunLimitExceeded, listen_for_signals
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        listen_for_signals()
    try:
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

