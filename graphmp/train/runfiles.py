"""The files of a run folder: a run folder is data, not instructions.

Run folders may come from anyone (downloaded, shared), so nothing read from one decides
which file graphmp opens, writes or deletes outside it:

- run_file(run_dir, meta, key, json_name): every file name read from train.json or
  checkpoint.json must be a string holding a bare file name (no '/', '\\', '..', NUL, not
  absolute) that matches what build_step / train write for that key (NAMES: step.onnx,
  infer.onnx, state.npz, ckpt-<digits>.npz), naming a regular file whose real path is
  inside realpath(run_dir) (so a symlink that leaves the folder is refused). Anything
  else is a one-line GraphmpError naming the JSON file and the key, and what to do.
- read_json(path, fix): a JSON object, or a one-line error naming the file (unreadable,
  truncated, corrupt, or another JSON type); check_meta / read_checkpoint check the
  types of what train.json / checkpoint.json hold before anything uses them.
- check_state(sess, state, names, run_dir): a state file's arrays fit the step graph.
- load_onnx(path): an ONNX model of the run (inline tensors only: a run's models never
  reference external data), or a one-line error naming the file.
- writing(path, what): an OSError while writing a run file (a full disk, a read-only
  folder) becomes a one-line error naming the file ("the disk is full" for ENOSPC).
- check_run_dir / clear_run_dir / write_run: train-graph's run folder, checked before any
  work (not empty without --force, writable, the model not one of its files), cleared of
  the old run's files only, then written (train.json last).
- run_paths(run_dir): the files graphmp writes in a run folder (RUN_NAMES and
  ckpt-<digits>.npz); refuse_run_files() refuses a user's file (data, the model) that is
  one of them, compared with paths.refuse_clobber (samefile / realpath).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat

import numpy as np

from ..errors import GraphmpError, first_line
from ..model_io import model_inputs
from ..paths import resolve_inside
from ..save import save_npz, write_json
from .builder import save_checked

TRAIN_JSON = "train.json"
CHECKPOINT = "checkpoint.json"
CKPT = r"ckpt-\d+\.npz"
# the key -> the file name pattern that build_step / train write for it
NAMES = {"step_model": r"step\.onnx", "infer_model": r"infer\.onnx", "initial_state": r"state\.npz",
         "state_file": CKPT}
# every file graphmp writes in a run folder (train-graph --force removes exactly these), train.json first
RUN_NAMES = ("train.json", "checkpoint.json", "summary.json", "loss.png", "loss.csv", "step.onnx", "state.npz",
             "infer.onnx")
RUN_FILE = re.compile("|".join(re.escape(n) for n in RUN_NAMES) + "|" + CKPT)
REBUILD = "rebuild the run with `graphmp train-graph MODEL -o RUN --force`"
FIX = {TRAIN_JSON: REBUILD,
       CHECKPOINT: "delete checkpoint.json to start over from the run's initial state (or rebuild the run)"}


def _show(value) -> str:
    s = repr(value)
    return s if len(s) <= 80 else s[:77] + "..."


def bad_name(value, pattern: str) -> str | None:
    """Why `value` is not a bare file name matching `pattern`, or None when it is one."""
    if not isinstance(value, str):
        return f"is {type(value).__name__} {_show(value)}, not a file name"
    if "\0" in value:
        return "holds a NUL byte"
    if os.path.isabs(value) or value.startswith(("/", "\\")) or value[1:2] == ":":
        return f"is an absolute path ({_show(value)})"
    if "/" in value or "\\" in value or value in ("", ".", ".."):
        return f"is {_show(value)}, not a bare file name in the run folder (graphmp reads only files it wrote there)"
    if not re.fullmatch(pattern, value):
        return f"is {_show(value)}, not a name graphmp writes there ({pattern.replace(chr(92), '')})"
    return None


def _outside(run_dir: str, name: str) -> str | None:
    """Why the bare name `name` in run_dir is not a regular file inside the folder (None when it is)."""
    real, inside = resolve_inside(run_dir, name)
    if not inside:
        return f"is a symlink to {real}, outside the run folder"
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        return f"cannot be opened ({e.strerror}): the run folder is incomplete"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def run_file(run_dir, meta, key: str, json_name: str = TRAIN_JSON) -> str:
    """The path (run_dir/name) of the run file that meta[key] names, checked as the module
    doc says; a one-line GraphmpError naming the JSON file, the key and the fix otherwise."""
    run_dir = os.fspath(run_dir)
    why = bad_name(meta[key], NAMES[key]) if isinstance(meta, dict) and key in meta else "is missing"
    if why is None:
        why = _outside(run_dir, meta[key])
        why = why and f"names {meta[key]}, which {why}"
    if why is not None:
        raise GraphmpError(f"{os.path.join(run_dir, json_name)}: key '{key}' {why}; {FIX.get(json_name, REBUILD)}")
    return os.path.join(run_dir, meta[key])


def json_file(run_dir, name: str) -> str | None:
    """run_dir/name (train.json, checkpoint.json) when it exists, checked to be a regular file
    inside the run folder; None when there is none."""
    path = os.path.join(os.fspath(run_dir), name)
    if not os.path.lexists(path):
        return None
    why = _outside(os.fspath(run_dir), name)
    if why is not None:
        raise GraphmpError(f"{path}: {why}; {FIX.get(name, REBUILD)}")
    return path


MAX_JSON_DEPTH = 32  # graphmp writes run JSON a few levels deep; deeper is not a run file


def _depth(data) -> int:
    """How deeply lists and objects nest in parsed JSON (iterative: no recursion limit)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:
                todo.extend((v, level + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def read_json(path: str, fix: str) -> dict:
    """The JSON object in the file `path` (a run's train.json / checkpoint.json), or a
    one-line GraphmpError naming it (unreadable, truncated, corrupt, nested deeper than
    MAX_JSON_DEPTH, not an object)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except OSError as e:
        raise GraphmpError(f"{path}: cannot be read ({e.strerror or e}); {fix}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise GraphmpError(f"{path}: is not valid JSON, truncated or corrupt ({first_line(e, 120)}); {fix}") from None
    except RecursionError:  # the parser's own limit (about 1000 levels)
        data = None
    if data is None or _depth(data) > MAX_JSON_DEPTH:
        raise GraphmpError(f"{path}: JSON nested more than {MAX_JSON_DEPTH} levels deep, so not a file graphmp "
                           f"wrote; {fix}")
    if not isinstance(data, dict):
        raise GraphmpError(f"{path}: holds a JSON {type(data).__name__}, not the object graphmp writes; {fix}")
    return data


# the train.json keys that training, eval and export use, and their JSON types
META_TYPES = {"inputs": dict, "input_types": dict, "label": dict, "model_output": str, "loss_output": str,
              "finite_output": str, "state": list, "weights": list, "bn_stats": list, "dynamic_scale": bool,
              "config": dict}


def check_meta(meta: dict, path: str) -> None:
    """train.json holds what the training code reads, with the JSON types it expects."""
    def bad(key, want):
        raise GraphmpError(f"{path}: key '{key}' is {_show(meta.get(key)) if key in meta else 'missing'}, "
                           f"not {want}; {REBUILD}")
    for key, t in META_TYPES.items():
        if not isinstance(meta.get(key), t):
            bad(key, f"a JSON {'object' if t is dict else 'array' if t is list else t.__name__}")
    if not all(isinstance(s, dict) and isinstance(s.get("input"), str) for s in meta["state"]):
        bad("state", "a list of {'input': name, ...} objects")
    for key in ("weights", "bn_stats"):
        if not all(isinstance(w, str) for w in meta[key]):
            bad(key, "a list of tensor names")
    if not isinstance(meta["label"].get("name"), str):
        bad("label", "an object with the label's 'name'")
    if not all(isinstance(meta["config"].get(k), str) for k in ("precision", "loss")):
        bad("config", "an object with the run's 'precision' and 'loss'")
    if "source" in meta and not (isinstance(meta["source"], str) and "\0" not in meta["source"]):
        bad("source", "the path of the model the run was built from")
    if meta.get("flat") is not None:  # a run built before flat state has none
        from .flat import check_flat
        check_flat(meta["flat"], bad)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def started_over_note(run_dir, resume: bool) -> str | None:
    """The line a run that starts over says (resume off, a checkpoint present): which
    checkpoint its own first checkpoint replaces. None when nothing is replaced."""
    if resume:
        return None
    try:
        ck = read_checkpoint(run_dir)[0]
    except GraphmpError:  # a damaged one: train() reports it on its own terms
        return None
    if ck is None:
        return None
    return (f"starting over (--no-resume): the run's checkpoint at step {ck.get('step')} is replaced at this run's "
            "first checkpoint")


def read_checkpoint(run_dir) -> tuple[dict | None, str | None]:
    """(checkpoint.json's dict, the path of the state file it names), both checked; (None,
    None) when the run has no checkpoint.json."""
    path = json_file(run_dir, CHECKPOINT)
    if path is None:
        return None, None
    ck = read_json(path, FIX[CHECKPOINT])
    state = run_file(run_dir, ck, "state_file", CHECKPOINT)
    for key in ("step", "epoch", "position", "skipped"):
        if not _count(ck.get(key)):
            raise GraphmpError(f"{path}: key '{key}' is {_show(ck.get(key))}, not a count; {FIX[CHECKPOINT]}")
    ev = ck.get("eval_history", [])
    if not isinstance(ck.get("setup"), dict) or not isinstance(ev, list) or not all(
            isinstance(e, dict) and all(isinstance(e.get(k), (int, float)) for k in ("step", "loss")) for e in ev):
        raise GraphmpError(f"{path}: key 'setup' or 'eval_history' is not what graphmp writes; {FIX[CHECKPOINT]}")
    return ck, state


def check_state(sess, state: dict, names, run_dir) -> None:
    """The state (a checkpoint or state.npz, maybe from elsewhere) has every tensor the step
    graph takes, in its dtype and fixed sizes: else one line, before any step."""
    missing = [n for n in names if n not in state]
    if missing:
        raise GraphmpError(f"{run_dir}: the state file lacks {missing[:5]}; it does not belong to this step graph.")
    for i in sess.get_inputs():
        if i.name not in names or i.shape is None:
            continue
        a = np.asarray(state[i.name])
        want = {"float": "float32", "double": "float64"}.get(i.type[7:-1], i.type[7:-1])
        if str(a.dtype) != want or len(a.shape) != len(i.shape) or any(
                isinstance(d, int) and d != n for d, n in zip(i.shape, a.shape)):
            raise GraphmpError(f"{run_dir}: the state file's '{i.name}' is {a.dtype} {list(a.shape)}, the step "
                               f"graph takes {want} {list(i.shape)}; it does not belong to this step graph.")


def load_onnx(path: str):
    """A model of the run folder (step.onnx, infer.onnx), or a one-line error naming it.
    graphmp writes them with inline tensors only, so one referencing external data (a file
    anywhere) is refused."""
    import onnx
    from onnx import TensorProto
    from ..paths import iter_tensors
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and others for a corrupt file
        raise GraphmpError(f"{path}: not a readable ONNX model, truncated or corrupt ({first_line(e, 120)}); "
                           f"{REBUILD}") from None
    if any(t.data_location == TensorProto.EXTERNAL for t in iter_tensors(m.graph)):
        raise GraphmpError(f"{path}: references external data files, which graphmp never writes in a run folder; "
                           f"{REBUILD}")
    return m


def os_error(e: OSError, path=None, what: str | None = None, after: str = "") -> GraphmpError:
    """The one-line error for an OSError on `path` (default: the error's file); what: what
    was being written (None: the error alone, for the CLI's net under unforeseen ones)."""
    path = path or e.filename or "graphmp"
    full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    why = f"{e.strerror or e}: the disk is full" if full else (e.strerror or str(e))
    head = f"could not write {what} ({why})" if what else why
    return GraphmpError(f"{path}: {head}{'; ' + after if after else ''}")


@contextlib.contextmanager
def writing(path, what: str, after: str = ""):
    """Turn an OSError (or the GraphmpError of graphmp.model_io's writers) while writing `path`
    into one line naming it, with `after` (what is still valid, what to do) appended."""
    try:
        yield
    except OSError as e:
        raise os_error(e, None if e.filename else path, what, after) from None
    except GraphmpError as e:
        if not after:
            raise
        raise GraphmpError(f"{e}; {after}") from None


def run_paths(run_dir) -> list[tuple[str, str]]:
    """(name, path) of every file graphmp writes in the run folder: RUN_NAMES (existing or
    not) and the ckpt-<digits>.npz there."""
    run_dir = os.fspath(run_dir)
    try:
        ckpts = sorted(n for n in os.listdir(run_dir) if re.fullmatch(CKPT, n))
    except OSError:
        ckpts = []
    return [(n, os.path.join(run_dir, n)) for n in RUN_NAMES + tuple(ckpts)]


def refuse_run_files(run_dir, given, fix: str) -> None:
    """given: (label, path) of files the user named (training data, a model and its data
    files; None paths skipped). A one-line error when one of them is a file graphmp writes
    in the run folder (run_paths), compared by paths.refuse_clobber (samefile, realpath)."""
    from ..paths import refuse_clobber
    for label, path in given:
        if path is None:
            continue
        for name, run_path in run_paths(run_dir):
            try:
                refuse_clobber([(name, run_path)], [(label, path)])
            except GraphmpError:
                raise GraphmpError(f"{path}: {label} is the run's {name} ({run_path}), a file graphmp writes in "
                                   f"the run folder; it would be overwritten or deleted. {fix}") from None


def export_inputs(run_dir, meta: dict) -> list[tuple[str, str]]:
    """(label, path) of what export must never overwrite: the run's files (run_paths) and
    the source model that train.json names with its external data files (read, by
    graphmp.model_io.model_inputs, only when it is a regular file)."""
    out = [(f"the run's {n}", p) for n, p in run_paths(run_dir)]
    src = meta.get("source")
    if isinstance(src, str) and "\0" not in src and os.path.isfile(src):
        out += model_inputs("the run's source model", src)
    return out


def check_run_dir(out_dir: str, force: bool, model_path: str, calibration=None) -> None:
    """Before any work: refuse a non-empty run folder unless force; a model (or one of its
    data files, or a calibration file) that is a file the run writes (--force would delete
    or replace it); a folder that cannot be written (read-only, permission denied)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise GraphmpError(f"{out_dir}: exists and is not a folder; choose another run folder with -o.")
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {".graphmp.lock"} and not force:  # runlock's file
        raise GraphmpError(f"{out_dir}: the run folder is not empty; choose another folder, or pass --force "
                           "(force=True) to replace its run (its checkpoints are deleted).")
    if os.path.isdir(out_dir):
        given = model_inputs("the model", model_path) if os.path.isfile(model_path) else []
        cal = calibration if isinstance(calibration, (list, tuple)) else []
        given += [("--calibration", os.fspath(c)) for c in cal if isinstance(c, (str, os.PathLike))]
        refuse_run_files(out_dir, given, "Move it out of the run folder, or choose another run folder with -o.")
    d = os.path.abspath(out_dir)
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    if not os.access(d, os.W_OK | os.X_OK):
        raise GraphmpError(f"{out_dir}: cannot write the run folder: {d} is read-only (permission denied); "
                           "choose a writable folder with -o.")


def clear_run_dir(out_dir: str) -> None:
    """Remove the old run's files (train.json first, so an interrupted rebuild is never taken
    for a complete run); called once the new step is built, so a failed build leaves the old
    run as it was. Only the names graphmp writes there (runfiles.RUN_FILE) and only regular
    files or symlinks (the link itself, never its target) are removed; everything else stays."""
    if os.path.isdir(out_dir):
        names = [n for n in os.listdir(out_dir) if RUN_FILE.fullmatch(n)]
        for n in sorted(names, key=lambda n: (n != "train.json", n)):
            p = os.path.join(out_dir, n)
            if stat.S_ISREG(os.lstat(p).st_mode) or os.path.islink(p):
                os.unlink(p)
    os.makedirs(out_dir, exist_ok=True)


def write_run(out_dir: str, step, infer, init: dict, meta: dict, full: bool) -> None:
    """Replace the run folder's files with the new run's (train.json last). An OSError (a
    read-only folder, a full disk) is one line naming the file, and says one thing about
    the folder: the new run's partial files are removed, and so is the folder when this
    call created it (nothing was written); a folder that held an old run holds none now
    (its files were replaced first), and the line says so."""
    created = not os.path.isdir(out_dir)
    try:
        with writing(out_dir, "the run folder"):
            clear_run_dir(out_dir)
            save_checked(step, os.path.join(out_dir, "step.onnx"), full=full)
            save_checked(infer, os.path.join(out_dir, "infer.onnx"), full=full)
            save_npz(os.path.join(out_dir, "state.npz"), init)
            write_json(os.path.join(out_dir, "train.json"), meta)
    except GraphmpError as e:
        _remove_partial_run(out_dir, created)
        said = re.sub(r"[;.] *(Check free disk space and permissions; )?nothing was written\.?$", "", str(e))
        if created:
            raise GraphmpError(f"{said}; nothing was written (the run folder was not created). Free space or "
                               "fix the permissions and run train-graph again") from None
        raise GraphmpError(f"{said}; the run folder holds no run now (its old run files were removed before the "
                           "new ones could be written). Free space or fix the permissions and run train-graph again "
                           "(with --force if the folder is not empty)") from None


def _remove_partial_run(out_dir: str, created: bool) -> None:
    """Remove the run files a failed write_run left (only graphmp's names), and the folder
    itself when write_run created it and nothing else is in it."""
    try:
        for n in os.listdir(out_dir):
            p = os.path.join(out_dir, n)
            if RUN_FILE.fullmatch(n) and (stat.S_ISREG(os.lstat(p).st_mode) or os.path.islink(p)):
                os.unlink(p)
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
    except OSError:
        pass  # the line already says what failed; what could not be removed stays
