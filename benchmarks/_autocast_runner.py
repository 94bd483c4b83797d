"""Run one NVIDIA ModelOpt AutoCast conversion; executed by benchmarks/convert.py
inside the separate AutoCast venv (see setup_autocast.sh).

    python _autocast_runner.py SRC DST [--options JSON]

OPTIONS is a JSON object of extra keyword arguments for
modelopt.onnx.autocast.convert_to_mixed_precision (defaults used here:
low_precision_type="fp16", keep_io_types=True, providers=["cpu"]).

Prints exactly one JSON line prefixed with "@@RESULT " on stdout:
  ok, error, time_s (load+convert+save, imports excluded), import_s,
  rss_after_import_bytes, peak_rss_bytes (this process's VmHWM, else its ru_maxrss),
  versions.
"""
import argparse
import json
import os
import resource
import sys
import time
import traceback

from common import RESULT_TAG, rss_now, vmhwm  # this script's folder is on sys.path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--options", default="{}")
    a = ap.parse_args()
    res = {"ok": False, "error": None}
    t0 = time.perf_counter()
    try:
        import importlib.metadata as md

        import onnx
        from modelopt.onnx.autocast import convert_to_mixed_precision

        res["versions"] = {
            p: md.version(p) for p in ("nvidia-modelopt", "onnx", "onnxruntime", "numpy")
        }
        res["import_s"] = time.perf_counter() - t0
        res["rss_after_import_bytes"] = rss_now()
        kw = dict(low_precision_type="fp16", keep_io_types=True, providers=["cpu"])
        kw.update(json.loads(a.options))
        t1 = time.perf_counter()
        model = convert_to_mixed_precision(onnx_path=a.src, **kw)
        large = model.ByteSize() > 1_800_000_000 if hasattr(model, "ByteSize") else True
        if large:
            onnx.save(model, a.dst, save_as_external_data=True, all_tensors_to_one_file=True,
                      location=os.path.basename(a.dst) + ".data")
        else:
            onnx.save(model, a.dst)
        res["time_s"] = time.perf_counter() - t1
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failure is a result
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    res["peak_rss_bytes"] = vmhwm() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
