"""Helpers the benchmark scripts share (convert.py, search.py, _autocast_runner.py): child
processes that print one "@@RESULT <json>" line (emit, run_child, record_failure), strict
JSON (json_default, clean_floats), error text (err), peak RSS of this process (vmhwm,
rss_now), which converters are installed (tool_availability) and the machine (machine_info).

The scripts import it with benchmarks/ on sys.path (a script's own folder is): `from common
import ...`. Standard library only at import time: _autocast_runner.py imports it inside
the AutoCast venv, which has no graphmp.
"""
from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_AUTOCAST_PY = os.environ.get("AUTOCAST_PYTHON", "/work/venv-modelopt/bin/python")
RESULT_TAG = "@@RESULT "


def vmhwm():
    """Peak RSS of this process image (VmHWM; unlike ru_maxrss it is reset by exec, so it
    does not inherit the parent's RSS through fork)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_now():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def emit(res):
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(res, default=json_default), flush=True)


def json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def clean_floats(o):
    """Strict JSON: inf/nan -> strings."""
    if isinstance(o, float):
        if math.isnan(o):
            return "nan"
        if math.isinf(o):
            return "inf" if o > 0 else "-inf"
        return o
    if isinstance(o, dict):
        return {k: clean_floats(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [clean_floats(v) for v in o]
    return o


def err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip()
    return msg[:2000]


def load_npz(path):
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run_child(cmd, timeout, log_prefix=None) -> dict:
    """Run cmd in a new process group; return rc, wall time, peak RSS (wait4 ru_maxrss),
    the parsed @@RESULT JSON and stderr tail. Never raises for child failure."""
    out = tempfile.TemporaryFile()
    err_file = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, stdout=out, stderr=err_file, stdin=subprocess.DEVNULL,
                         start_new_session=True, env=env, cwd=str(REPO))
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        while True:
            try:
                _, status, ru = os.wait4(p.pid, 0)
                break
            except InterruptedError:
                continue
    finally:
        timer.cancel()
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    p.returncode = rc
    try:  # reap stragglers in the group
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    out.seek(0)
    err_file.seek(0)
    stdout = out.read().decode("utf-8", "replace")
    stderr = err_file.read().decode("utf-8", "replace")
    out.close()
    err_file.close()
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_TAG):
            try:
                result = json.loads(line[len(RESULT_TAG):])
            except json.JSONDecodeError:
                pass
    crash = None
    if timed_out.is_set():
        crash = f"timeout after {timeout:.0f} s (killed)"
    elif rc < 0:
        try:
            crash = f"crashed with signal {signal.Signals(-rc).name}"
        except ValueError:
            crash = f"crashed with signal {-rc}"
    elif result is None:
        crash = f"exited {rc} without a result"
    return {"rc": rc, "wall_s": wall, "peak_rss_bytes": ru.ru_maxrss * 1024,
            "timed_out": timed_out.is_set(), "crash": crash, "result": result,
            "stderr_tail": (stderr[-1500:] if (crash or (result and not result.get("ok", True))) else None)}


def record_failure(row: dict, child: dict, result: dict) -> bool:
    """When a conversion child (run_child) crashed, timed out or reported failure, put
    status, error and traceback (or stderr tail) into the row; True when it did."""
    if not child["crash"] and result.get("ok"):
        return False
    row["status"] = "timeout" if child["timed_out"] else ("crashed" if child["crash"] else "failed")
    row["error"] = "; ".join(x for x in (child["crash"], result.get("error")) if x) or None
    if result.get("traceback"):
        row["traceback"] = result["traceback"]
    elif child.get("stderr_tail"):
        row["stderr_tail"] = child["stderr_tail"]
    return True


def tool_availability(tools, autocast_py) -> dict:
    av = {}
    for t in tools:
        if t == "graphmp":
            r = subprocess.run([sys.executable, "-c",
                                "import sys; sys.path.insert(0, sys.argv[1]); import graphmp; graphmp.convert;"
                                "print(getattr(graphmp, '__version__', ''))", str(REPO)],
                               capture_output=True, text=True)
            av[t] = {"ok": r.returncode == 0, "version": r.stdout.strip() or None,
                     "error": None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]}
        elif t == "occ":
            try:
                import importlib.metadata as md

                av[t] = {"ok": True, "version": md.version("onnxconverter-common"), "error": None}
            except Exception as e:  # noqa: BLE001
                av[t] = {"ok": False, "version": None, "error": err(e)}
        elif t == "autocast":
            if not (autocast_py and os.path.exists(autocast_py)):
                av[t] = {"ok": False, "version": None,
                         "error": f"AutoCast venv python not found ({autocast_py}); run benchmarks/setup_autocast.sh"}
                continue
            code = ("import json, importlib.metadata as md, importlib.util as u;"
                    "assert u.find_spec('modelopt.onnx.autocast'), 'modelopt.onnx.autocast not importable';"
                    "print(json.dumps({p: md.version(p) for p in "
                    "('nvidia-modelopt','onnx','onnxruntime','numpy','torch')}))")
            r = subprocess.run([autocast_py, "-c", code], capture_output=True, text=True)
            if r.returncode == 0:
                vs = json.loads(r.stdout)
                av[t] = {"ok": True, "version": vs.get("nvidia-modelopt"), "versions": vs, "error": None,
                         "python": autocast_py}
            else:
                av[t] = {"ok": False, "version": None, "python": autocast_py,
                         "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return av


def machine_info() -> dict:
    import importlib.metadata as md

    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:  # noqa: BLE001
        pass
    pkgs = {}
    for p in ("onnx", "onnxruntime", "onnxconverter-common", "numpy", "protobuf", "psutil", "ml_dtypes"):
        try:
            pkgs[p] = md.version(p)
        except md.PackageNotFoundError:
            pkgs[p] = None
    git = {}
    for key, args in (("commit", ["rev-parse", "HEAD"]), ("status", ["status", "--porcelain"])):
        try:
            r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20)
            git[key] = r.stdout.strip() if r.returncode == 0 else None
        except Exception:  # noqa: BLE001
            git[key] = None
    git["dirty"] = bool(git.pop("status", None))
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": mem,
            "platform": platform.platform(), "python": sys.version.split()[0],
            "python_executable": sys.executable, "packages": pkgs, "git": git}
