"""What the commands share around their files: default output names, user-named JSON
outputs, and the checks made before any long work (writable, not an input file)."""
from __future__ import annotations

import os


# graphmp.model_io imports onnx and numpy (0.3 s): `graphmp --help` and usage errors need neither
def write_json(path, data):
    """A user-named JSON output (--report, --json): atomic, or written in place into a
    FIFO or character device (--report /dev/stdout)."""
    from ..save import write_json as write
    return write(path, data, in_place_ok=True)


def write_report(path, data, written: str):
    """write_json for a report written after the command's main output `written` (convert,
    pad): a failure (a full disk) says that output was written and the report was not,
    never "nothing was written"."""
    import re
    from ..errors import GraphmpError
    try:
        write_json(path, data)
    except GraphmpError as e:
        said = re.sub(r"[;.] *nothing was written\.?$", "", str(e))
        raise GraphmpError(f"{said}; the report was not written, but {written} was (complete)") from None


def refuse_clobber(outputs, models=(), files=()):
    """One line before any work when an output (label, path) is one of the input files:
    each model in `models` (label, path) with the data files it references, and `files`
    (label, path or list of paths: calibration, data)."""
    from ..model_io import model_inputs
    from ..paths import refuse_clobber as refuse
    inputs = []
    for what, path in models:
        if path is not None:
            inputs += model_inputs(what, path)
    for what, paths in files:
        if paths is not None and not isinstance(paths, (list, tuple)):
            paths = [paths]
        inputs += [(what, p) for p in paths or () if p not in ("auto", "off")]
    refuse(outputs, inputs)


def writable(path, what):
    """Fail before long work when a user-named text output cannot be written (nothing is
    written); a FIFO or character device is written in place."""
    if path:
        from ..model_io import check_writable as check
        check(path, None, what, in_place_ok=True)


def default_output(model: str, suffix: str) -> str:
    """-o left out: the model's file name with `suffix` in the current directory, so that
    nothing is written into the source model's folder (a repository's models/, a read-only
    mount) unless the user is working there. A file already there is not the user's to lose
    to a name they never gave: a one-line error asks for -o."""
    out = os.path.splitext(os.path.basename(model))[0] + suffix
    if os.path.lexists(out):
        from ..errors import GraphmpError
        raise GraphmpError(f"{out} exists in the current directory (the default output for {model}); "
                           f"give -o {out} to replace it, or another -o path")
    return out


def load_check_failed(e, out: str, fix: str) -> int:
    """The one line for a LoadCheckFailed (graphmp/load_check.py): the cause, what is on
    disk, the fix; exit 1."""
    import sys

    from . import _one_line  # names from the model may hold control characters
    ext = e.result.get("loads_with_extended")
    print(f"graphmp: load check FAILED: {_one_line(str(e))}. Nothing was written to {out} (a file already there is unchanged). "
          + (fix if ext else "ONNX Runtime cannot open or run it at any optimization level: please report this "
             "model (--no-load-check writes it for inspection)."), file=sys.stderr)
    return 1
