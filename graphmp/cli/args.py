"""Argument groups several subcommands share: one function per option (or pair of options),
with the help text a command words differently passed in."""
from __future__ import annotations

SHAPES_HELP = ("input shapes for generated inputs, trtexec syntax: x:1x3x640x640,mask:1x640 (only inputs with "
               "dynamic dims need one). Default: graphmp tries plausible sizes and uses the first that runs")

METRICS = ["max-rel", "max-abs", "argmax"]


def add_verbosity(p, quiet_text: str = "print nothing but errors", verbose_text: str | None = None):
    """-q/--quiet and -v/--verbose (-vv), one group on every command: args.quiet is True for
    -q, args.verbose counts the -v's (graphmp.progress reads the level the CLI sets from them)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help=quiet_text)
    g.add_argument("-v", "--verbose", action="count", default=0,
                   help=verbose_text or "say more on stderr: -v the steps, their timings and progress lines also "
                   "when stderr is not a terminal; -vv also the per-node decisions")


def add_quiet(p, text: str = "print nothing but errors"):
    """The verbosity group (-q, -v/-vv); the name older call sites use."""
    add_verbosity(p, text)


def add_shapes(p, text: str = SHAPES_HELP):
    p.add_argument("--shapes", metavar="NAME:DIMS,...", help=text)


def add_output(p, text: str, **kw):
    """-o/--output: the file (or folder) a command writes."""
    p.add_argument("-o", "--output", help=text, **kw)


def add_report(p, text: str):
    p.add_argument("--report", metavar="JSON", help=text)


def add_json(p, text: str):
    p.add_argument("--json", metavar="PATH", help=text)


def add_data(p, text: str, **kw):
    """--data: input arrays (.npz, one array per model input)."""
    p.add_argument("--data", metavar="NPZ", help=text, **kw)


def add_calibration(p, text: str):
    p.add_argument("--calibration", nargs="+", metavar="NPZ", help=text)


def add_load_check(p, what: str):
    """--no-load-check: write the output without opening it in ONNX Runtime first."""
    p.add_argument("--no-load-check", dest="load_check", action="store_false", default=True,
                   help=f"write the {what} without the load check. By default it replaces the output only after ONNX "
                   "Runtime (CPU provider, default session options) opened it and ran it once in a child process; "
                   "a model the runtime cannot open or run (a crash, an error, no answer within a time that grows "
                   "with the model's size) is exit 1 and nothing is written")


def add_validate(p, text: str):
    p.add_argument("--validate", action="store_true", help=text)


def add_external_data(p, default_text: str):
    """--external-data / --no-external-data; `default_text` says when the weights go
    to OUTPUT.data by default."""
    p.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                   help="write weights to OUTPUT.data (OUTPUT.1.data while an existing OUTPUT.data is still in use: "
                   f"the pair is replaced atomically; default: {default_text})")
    p.add_argument("--no-external-data", dest="external_data", action="store_false")


def add_max_error(p, text: str, metavar: str, **kw):
    """--max-error: the accuracy budget."""
    p.add_argument("--max-error", metavar=metavar, help=text, **kw)


def add_metric(p, text: str):
    """--metric: the error --max-error bounds."""
    p.add_argument("--metric", choices=METRICS, default="max-rel", help=text)


def add_tolerances(p, atol_text: str):
    """--atol/--rtol: an element-wise |a-b| <= atol + rtol*|ref| requirement."""
    p.add_argument("--atol", type=float, help=atol_text)
    p.add_argument("--rtol", type=float, help="see --atol")


def add_model_type(p, text: str):
    """--model-type: the model type of ONNX Runtime's transformer optimizer."""
    p.add_argument("--model-type", metavar="TYPE", help=text)


def add_timing_cache(p, text: str):
    """--timing-cache: the TensorRT timing cache to read and write back."""
    p.add_argument("--timing-cache", metavar="FILE", help=text)


def add_workspace(p, text: str):
    """--workspace: the TensorRT builder's workspace limit."""
    p.add_argument("--workspace", type=int, metavar="MB", help=text)


def add_seed(p, text: str | None = None):
    p.add_argument("--seed", type=int, default=0, help=text)
