"""The load check: open a model in ONNX Runtime, and run it once, in a child process.

ONNX Runtime can kill the process that opens a model (a segfault in a graph optimizer at
session creation, passes/ort_crash.py), so a model graphmp wrote is opened only in a child
process: `probe(path)` returns what happened (it loaded and ran; it raised an error; it
died of a signal; it did not finish within the time allowed) and never takes the caller
down. `convert` and `pad` run it on the finished temporary output before it replaces the
output path (graphmp/save.py's before_commit), so a model the runtime cannot open is never
written; `graphmp.session()` and `graphmp bench` run it before opening a model in their own
process.

The check never changes what is written: it passes or fails it. Its time limit grows with
the model's size (timeout_for), not with a budget of the run.

Run as a module (`python -m graphmp.load_check MODEL SPEC_JSON`) it is the child: it prints
one JSON line per stage it reaches, so the parent knows where a crash happened.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .errors import GraphmpError

BASE_TIMEOUT_S = 120.0      # process start, imports, session creation and one run of a small model
TIMEOUT_PER_GB_S = 120.0    # reading, optimizing and running each GB of weights once, on a slow CPU
DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
NO_KERNEL = "Could not find an implementation"  # ONNX Runtime's NOT_IMPLEMENTED for an op type it has no kernel of
ERROR_EXIT = 3              # the child's exit code for an error it caught (an exception, not a crash)
_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(bfloat16)": "bfloat16", "tensor(int64)": "int64", "tensor(int32)": "int32",
              "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool"}


def model_bytes(path: str) -> int:
    """The model file plus the external data files it names in its own folder (0 for one
    that cannot be read: the probe then says why)."""
    import onnx

    from .model_io import iter_graphs
    try:
        total = os.path.getsize(path)
        m = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - the child reports an unreadable model
        return 0
    folder = os.path.dirname(os.path.abspath(path))
    names = {e.value for g in iter_graphs(m.graph) for t in g.initializer for e in t.external_data
             if e.key == "location"}
    for name in names:
        f = os.path.realpath(os.path.join(folder, name))
        if os.path.dirname(f) == os.path.realpath(folder) and os.path.isfile(f):
            total += os.path.getsize(f)
    return total


def timeout_for(nbytes: int) -> float:
    """Seconds the check may take for a model of `nbytes` (weights included)."""
    return BASE_TIMEOUT_S + TIMEOUT_PER_GB_S * nbytes / 1e9


def probe(path, feeds: dict | None = None, *, run: bool = True, shapes=None, providers=DEFAULT_PROVIDERS,
          options: dict | None = None, timeout: float | None = None, shown_as: str | None = None) -> dict:
    """Open `path` in ONNX Runtime in a child process, then (run=True) run it once on
    `feeds` ({input: array}, cast to the types the session asks for), or, without feeds,
    on inputs graphmp.inputs generates (`shapes`: --shapes for the dynamic dims).
    providers: as InferenceSession takes them; options: SessionOptions attributes (an enum
    by its name), default: ONNX Runtime's defaults (graph_optimization_level ORT_ENABLE_ALL).

    Returns {"passed", "stage" (how far it got: load, inputs, run, done), "ran", "error"
    (one line, None when passed), "crashed" (the signal's name, or None), "note", "inputs",
    "seconds", "timeout_s", "runtime"}. Never raises for what the model does. shown_as: the
    name the child's messages give the model (the output a temporary file will become)."""
    path = os.fspath(path)
    timeout = timeout_for(model_bytes(path)) if timeout is None else timeout
    spec = {"providers": [p if isinstance(p, str) else [p[0], dict(p[1])] for p in providers],
            "options": _plain(options or {}), "run": bool(run), "shapes": shapes, "feeds": None,
            "shown_as": shown_as or path}
    tmp = tempfile.mkdtemp(prefix="graphmp-load-check-")
    t0 = time.perf_counter()
    try:
        if run and feeds:
            import numpy as np
            spec["feeds"] = os.path.join(tmp, "feeds.npz")
            np.savez(spec["feeds"], **{k: np.asarray(v) for k, v in feeds.items()})
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        proc = _start(path, os.path.join(tmp, "spec.json"))
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            timed_out = True
        except BaseException:  # Ctrl-C, SIGTERM: the child (its own session, so no SIGINT reaches it) goes too
            _kill(proc)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = _verdict(proc.returncode, out, err, timed_out, timeout)
    res.update(seconds=round(time.perf_counter() - t0, 3), timeout_s=round(timeout, 1), runtime=_runtime(spec))
    return res


def _plain(options: dict) -> dict:
    """SessionOptions values as JSON: numbers, strings, booleans; an enum by its name."""
    out = {}
    for k, v in options.items():
        out[k] = v if isinstance(v, (bool, int, float, str)) or v is None else getattr(v, "name", str(v))
    return out


def _start(path: str, spec_path: str):
    """The child: this module run by the same Python, graphmp importable from where this
    process imported it; its own process group, so a timeout ends everything it started."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # started in graphmp's own root, so `-m` finds this graphmp whatever folder the caller is in
    return subprocess.Popen([sys.executable, "-m", "graphmp.load_check", os.path.abspath(path), spec_path],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                            start_new_session=True)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


def _verdict(code: int, out: str, err: str, timed_out: bool, timeout: float) -> dict:
    """The parent's reading of the child's stage lines and exit."""
    said = {}
    for line in (out or "").splitlines():
        try:
            said.update(json.loads(line))
        except ValueError:
            continue
    stage = said.get("stage", "start")
    res = {"passed": False, "stage": stage, "ran": stage == "done" and said.get("ran", False), "error": None,
           "crashed": None, "note": said.get("note"), "inputs": said.get("inputs"),
           "providers": said.get("providers")}
    where = {"start": "before opening the model", "load": "while creating the session",
             "inputs": "while finding input shapes (trial runs)", "run": "while running the model once",
             "done": "after running"}[stage] if stage in ("start", "load", "inputs", "run", "done") else stage
    if timed_out:
        res["error"] = f"did not finish within {timeout:.0f} s ({where}); stopped"
    elif code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        res["crashed"] = name
        res["error"] = f"ONNX Runtime crashed the process ({name}) {where}"
    elif code == 0 and stage == "done":
        res["passed"] = True
    elif said.get("error"):
        res["error"] = f"{said['error']} ({where})"
    else:
        tail = [x for x in (err or "").strip().splitlines() if x.strip()][-1:] or [f"exit code {code}"]
        res["error"] = f"the check's process ended {where}: {tail[0][:300]}"
    return res


def _runtime(spec: dict) -> str:
    try:
        import onnxruntime as ort
        version = ort.__version__
    except Exception:  # noqa: BLE001
        version = "?"
    names = [p if isinstance(p, str) else p[0] for p in spec["providers"]]
    opts = ", ".join(f"{k}={v}" for k, v in spec["options"].items() if k != "log_severity_level")
    return f"onnxruntime {version}, {', '.join(names)}, " + (f"session options {opts}" if opts else
                                                              "default session options (ORT_ENABLE_ALL)")


def failure_text(res: dict, extended: dict | None = None) -> str:
    """One line: what the check saw and, with the ORT_ENABLE_EXTENDED retry, whether an
    ORT_ENABLE_ALL graph optimizer is the cause."""
    text = f"{res['runtime']}: {res['error']}"
    if extended is not None and extended.get("passed"):
        text += ("; with graph_optimization_level=ORT_ENABLE_EXTENDED it loads and runs, so one of ONNX Runtime's "
                 "ORT_ENABLE_ALL graph optimizers fails on it")
    return text


def retry_extended(path, feeds: dict | None = None, shapes=None, timeout: float | None = None) -> dict:
    """probe() again with graph_optimization_level=ORT_ENABLE_EXTENDED (the diagnosis of a failure)."""
    return probe(path, feeds, shapes=shapes, options={"graph_optimization_level": "ORT_ENABLE_EXTENDED",
                                                      "log_severity_level": 3}, timeout=timeout)


class LoadCheckFailed(GraphmpError):
    """The written model did not pass the load check: `result` is probe()'s, `report` the
    command's report (set by the command that raised it), nothing was written."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result
        self.report = None


class Gate:
    """save_model's before_commit: probe() on the finished temporary file; a failure (after
    the ORT_ENABLE_EXTENDED retry that names the cause) raises LoadCheckFailed, so the
    temporary file goes and the output path is untouched. `result`: the last probe's."""

    def __init__(self, feeds: dict | None = None, shapes=None, log=None, bf16: bool = False, shown_as=None):
        self.feeds, self.shapes, self.log, self.result, self.bf16 = feeds, shapes, log, None, bf16
        self.shown_as = shown_as  # the output path the temporary file becomes, for messages

    def __call__(self, tmp_path: str) -> None:
        if self.log:
            self.log("load check: opening and running the output in ONNX Runtime (a child process)")
        res = self.result = probe(tmp_path, self.feeds, shapes=self.shapes, shown_as=self.shown_as)
        if res["passed"]:
            return
        if self.bf16 and res["crashed"] is None and NO_KERNEL in (res["error"] or ""):
            # ONNX Runtime's CPU provider has no BF16 MatMul/Conv (nor a fallback, as it has for FP16):
            # a BF16 model is for ORT CUDA and TensorRT, and this check cannot judge it here
            res.update(passed=None, note=f"not judged: the CPU provider has no BF16 kernel for an op of the model "
                                         f"({res['error'][:200]}); a BF16 model runs on ORT CUDA or TensorRT")
            return
        ext = retry_extended(tmp_path, self.feeds, self.shapes, timeout=res["timeout_s"])
        res["loads_with_extended"] = bool(ext["passed"])
        raise LoadCheckFailed(failure_text(res, ext), res)


def summary_line(res: dict | None) -> str | None:
    """The report's load check in one summary line (None when it did not run)."""
    if not res:
        return None
    if res.get("skipped"):
        return f"  load check: skipped ({res['skipped']})"
    if res["passed"] is None:
        return f"  load check: {res['runtime']}: {res['note']}"
    if res["passed"]:
        return f"  load check: {res['runtime']}: {res['note']}, {res['seconds']:.1f} s"
    return f"  load check: FAILED: {failure_text(res)}"


# --------------------------------------------------------------------------- the child
def _say(**d) -> None:
    print(json.dumps(d, default=str), flush=True)


def _session_options(ort, options: dict):
    so = ort.SessionOptions()
    so.log_severity_level = 3  # errors only: the parent reports in one line
    for k, v in options.items():
        current = getattr(so, k)
        members = getattr(type(current), "__members__", None)
        setattr(so, k, members[v] if members and isinstance(v, str) else v)
    return so


def _feeds(sess, spec: dict, path: str):
    """({input: array} in the session's types, how they were made) or (None, why not)."""
    import numpy as np
    if spec["feeds"]:
        with np.load(spec["feeds"], allow_pickle=False) as z:
            given = {k: z[k] for k in z.files}
        how = "given"
    else:
        import onnx

        from graphmp.errors import GraphmpError
        from graphmp.inputs import find_shapes
        model = onnx.load(path, load_external_data=False)
        try:
            plan = find_shapes(model, lambda f: sess.run(None, f), spec["shapes"], where=spec.get("shown_as") or path)
            given, how = plan.feeds(0), plan.describe()  # generate() refuses inputs over its size cap
        except GraphmpError as e:
            return None, f"not run: {e}"
    feeds = {}
    for i in sess.get_inputs():
        if i.name not in given:
            return None, f"not run: no data for input '{i.name}'"
        dtype = _ORT_TYPES.get(i.type)
        x = given[i.name]
        if dtype == "bfloat16":
            import ml_dtypes
            x = x.astype(ml_dtypes.bfloat16)
        elif dtype is not None:
            x = x.astype(dtype)
        feeds[i.name] = x
    return feeds, how


def _child(path: str, spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    _say(stage="load")
    import onnxruntime as ort
    try:
        providers = [p if isinstance(p, str) else (p[0], p[1]) for p in spec["providers"]]
        sess = ort.InferenceSession(path, _session_options(ort, spec["options"]), providers=providers)
    except Exception as e:  # noqa: BLE001 - reported to the parent in one line
        _say(error=f"{type(e).__name__}: {_line(e)}")
        return ERROR_EXIT
    _say(stage="inputs", providers=sess.get_providers())
    if not spec["run"]:
        _say(stage="done", ran=False, note="loaded; not run (load only)")
        return 0
    feeds, how = _feeds(sess, spec, path)
    if feeds is None:
        _say(stage="done", ran=False, note=f"loaded; {how}")
        return 0
    _say(stage="run", inputs=", ".join(f"{k}:{'x'.join(map(str, v.shape))}" for k, v in feeds.items()))
    try:
        sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001
        _say(error=f"{type(e).__name__}: {_line(e)}")
        return ERROR_EXIT
    shapes = ", ".join(f"{k}:{'x'.join(map(str, v.shape))}" for k, v in feeds.items())
    _say(stage="done", ran=True, note=f"loaded and ran once on the given inputs ({shapes})" if how == "given" else
         f"loaded and ran once on generated inputs ({how})")
    return 0


def _line(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
