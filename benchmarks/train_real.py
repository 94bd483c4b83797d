#!/usr/bin/env python
"""Real-model training sweep, through the CLI only (issue 14 "Done means").

For every model in models/real, models/build and models/tiny (a file byte-identical to one
already swept is reported as such, not run again):
  1. pick the batch and shapes from the model's own inputs: a symbolic batch axis gets
     batch 2 (1 when the model does not run at 2 in ONNX Runtime), other symbolic dims 64;
     where the model runs at neither, the shapes graphmp.inputs.find_shapes finds (what
     `graphmp convert` uses without --shapes); integer inputs get values in {0, 1}, float
     inputs N(0, 1);
  2. run the model once in ONNX Runtime at those shapes to read its first output's shape
     and pick the loss from it: cross-entropy when the output is [N, C] (C >= 2, classes on
     axis 1) or [N, T, V] with V >= 100 (a sequence model's logits: --class-axis -1), else
     mse against U(0, 1) targets of the output's shape;
  3. `graphmp train-graph` (fp32, then mixed) -- when its one-line error gives advice (an
     output made by Softmax: `--model-output X`; an output of unknown shape: give the label
     shape, taken from the output's measured shape with the batch axis N), it is run again
     with that flag; a warning that names `--lr X` (weights small beside the default lr) is
     taken the same way -- then `graphmp train` for 20 steps (4 batches x 5 epochs of random
     data: the loss of a model that can learn falls as it memorises them).
Recorded per model and precision: built (or the one-line error), loss mean of the first 5
and last 5 steps and of the first and last epoch (from the run's checkpoint history; "falling":
the last epoch's mean below the first's, the same samples each), skipped steps, median step time.

Usage: python benchmarks/train_real.py [--json out.json] [--models NAME,...] [--dir DIR] [--timeout 420]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ("models/real", "models/build", "models/tiny")
STEPS, BATCHES_PER_EPOCH = 20, 4
ELEM = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
        onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.BOOL: np.bool_}


def graphmp_cmd() -> list:
    exe = os.path.join(os.path.dirname(sys.executable), "graphmp")
    return [exe] if os.path.exists(exe) else [sys.executable, "-c", "import sys; from graphmp.cli import main; "
                                                                    "sys.exit(main())"]


def data_inputs(model):
    inits = {i.name for i in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in inits]


def shapes_for(model, batch: int) -> dict:
    """{input: dims}: a symbolic (or 0/-1) first axis -> batch, other symbolic dims -> 64."""
    out = {}
    for v in data_inputs(model):
        dims = []
        for i, d in enumerate(v.type.tensor_type.shape.dim):
            fixed = d.HasField("dim_value") and d.dim_value > 0
            dims.append(d.dim_value if fixed else (batch if i == 0 else 64))
        out[v.name] = dims
    return out


def whole_inputs(model) -> set:
    """Inputs with a fixed first axis beside one with a free first axis (an RNN's initial
    state): graphmp train takes them whole, given once (graphmp.train.data.whole_arrays)."""
    def first(v):
        d = v.type.tensor_type.shape.dim
        return None if not d else (d[0].dim_value if d[0].HasField("dim_value") and d[0].dim_value > 0 else "free")
    heads = {v.name: first(v) for v in data_inputs(model)}
    if "free" not in heads.values():
        return set()
    return {n for n, h in heads.items() if h != "free" and h is not None}


def random_inputs(model, shapes: dict, n: int | None, rng) -> dict:
    """Random values of every input: at `shapes` (n None), or n samples (first axis = samples,
    graphmp train's data layout; an input without a batch axis then does not fit it, and
    graphmp train says so)."""
    out = {}
    whole = whole_inputs(model)
    for v in data_inputs(model):
        dt = ELEM.get(v.type.tensor_type.elem_type, np.float32)
        dims = shapes[v.name]
        if n is not None and v.name in whole:  # no batch axis: given once, zeros (an initial state)
            out[v.name] = np.zeros(dims, dt)
            continue
        full = dims if n is None else ([n] + dims[1:] if dims else [])
        if np.issubdtype(dt, np.integer) or dt == np.bool_:
            out[v.name] = rng.integers(0, 2, full).astype(dt)
        else:
            out[v.name] = rng.standard_normal(full).astype(dt)
    return out


def probe(path, model, rng, batch_size=None):
    """(batch, shapes, first output's shape) of the first batch (2, then 1) the model runs at;
    raises RuntimeError with ORT's first line when neither runs."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    out = sess.get_outputs()[0].name
    err = None
    for batch in ((batch_size,) if batch_size else (2, 1)):
        shapes = shapes_for(model, batch)
        feeds = random_inputs(model, shapes, None, rng)
        try:
            y = sess.run([out], feeds)[0]
            first = next(iter(shapes.values()), [batch])  # a fixed batch axis keeps its size
            return (first[0] if first else batch), shapes, list(y.shape)
        except Exception as e:  # noqa: BLE001 -- the model does not run at this batch
            err = str(e).strip().splitlines()[0][:200]
    # graphmp's own search for sizes that run (what `graphmp convert` does without --shapes)
    from graphmp.errors import GraphmpError
    from graphmp.inputs import find_shapes
    try:
        plan = find_shapes(model, lambda f: sess.run([out], f), where=os.path.basename(path))
    except GraphmpError as e:
        raise RuntimeError(f"does not run in ONNX Runtime at the shapes tried: {err}; {e}") from None
    b = 2 if plan.batch_free else None
    shapes = {n: list(v) for n, v in plan.shapes_for_batch(b).items()}
    batch = next((shapes[n][a] for n, a in plan.batch_dims), next(iter(shapes.values()), [1])[0])
    try:  # the values it found (value hints, e.g. a sample rate), then this script's random ones
        y = sess.run([out], plan.feeds(0, b))[0]
        sess.run([out], random_inputs(model, shapes, None, rng))
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"runs only on the values graphmp.inputs chose, not on random data: "
                           f"{str(e).strip().splitlines()[0][:200]}") from None
    return batch, shapes, list(y.shape)


def pick_loss(out_shape) -> tuple[str, list]:
    """(loss, extra train-graph flags) as the output's shape suggests (see the docstring)."""
    if len(out_shape) == 2 and out_shape[1] >= 2:
        return "cross-entropy", []
    if len(out_shape) == 3 and out_shape[2] >= 100:
        return "cross-entropy", ["--class-axis", "-1"]
    return "mse", []


def labels_for(loss, out_shape, n, rng):
    if loss == "cross-entropy":
        if len(out_shape) == 2:
            return rng.integers(0, out_shape[1], [n]).astype(np.int64)
        return rng.integers(0, out_shape[2], [n, out_shape[1]]).astype(np.int64)
    return rng.random([n] + out_shape[1:]).astype(np.float32)


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith(("error", "graphmp: error", "Error"))]
    return (errs[-1] if errs else (lines[-1] if lines else "(no output)"))[:300]


def run(cmd, timeout):
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout} s", time.perf_counter() - t0


def relabel(plan, error: str) -> bool:
    """Take graphmp's advice `--label-shape D,..` (an output whose real shape is not its
    declared one): labels of that shape per sample, flag added; False when there is none."""
    m = re.search(r"--label-shape ([\d,]+)", error)
    if not m or "--label-shape" in plan["retry_flags"]:
        return False
    shape = [int(d) for d in m.group(1).split(",")]
    plan["retry_flags"] += ["--label-shape", m.group(1)]
    with np.load(plan["data"]) as f:
        data = dict(f)
    data["labels"] = np.random.default_rng(1).random([plan["n"]] + shape).astype(np.float32)
    np.savez(plan["data"], **data)
    return True


def sweep_one(path, precision, plan, work, timeout, again=True) -> dict:
    g = graphmp_cmd()
    run_dir = os.path.join(work, f"run-{precision}")
    shape_flag = ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in plan["shapes"].items())
    cmd = g + ["train-graph", path, "-o", run_dir, "--force", "--precision", precision, "--loss", plan["loss"],
               "--shapes", shape_flag] + plan["flags"]
    rc, out, secs = run(cmd + plan["retry_flags"], timeout)
    for _ in range(2):  # train-graph's own advice, taken once each: the logits, the label shape
        m = re.search(r"--model-output (\S+?)\)?\.?$", one_line(out)) if rc else None
        if m:
            plan["retry_flags"] += ["--model-output", m.group(1)]
        elif rc and "is unknown; give label_shape" in out:
            plan["retry_flags"] += ["--label-shape", plan["label_shape"]]
        elif rc and relabel(plan, out):
            pass
        else:
            break
        rc, out, secs = run(cmd + plan["retry_flags"], timeout)
    lr = re.search(r"give --lr (\S+) \(", out) if rc == 0 else None
    if lr and "--lr" not in plan["retry_flags"]:  # train-graph's warning: weights small beside the default lr
        plan["retry_flags"] += ["--lr", lr.group(1)]
        rc, out, secs = run(cmd + plan["retry_flags"], timeout)
    row = {"precision": precision, "built": rc == 0, "build_s": round(secs, 1)}
    if rc:
        row["error"] = one_line(out)
        return row
    rc, out, secs = run(g + ["train", run_dir, "--data", plan["data"], "--batch-size", str(plan["batch"]),
                             "--epochs", str(STEPS // BATCHES_PER_EPOCH), "--max-steps", str(STEPS), "-q",
                             "--device", "cpu", "--checkpoint-every", "0"], timeout)
    row["train_s"] = round(secs, 1)
    if rc and again and relabel(plan, out):  # the output's real shape, from the first step
        return sweep_one(path, precision, plan, work, timeout, again=False)
    if rc and again and plan["batch"] != 1 and "use batch size 1" in out:  # an output with no batch axis
        plan["batch"] = 1
        return sweep_one(path, precision, plan, work, timeout, again=False)
    if rc:
        row["trained"] = False
        row["error"] = one_line(out)
        return row
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run_dir, "checkpoint.json")) as f:
        ck = json.load(f)
    hist = np.load(os.path.join(run_dir, ck["state_file"]))["__history__loss"]
    row.update(trained=True, steps=int(s["steps"]), skipped=int(s["skipped_steps"]),
               loss_first5=float(np.mean(hist[:5])), loss_last5=float(np.mean(hist[-5:])),
               ms_per_step=round(s["seconds_per_step"] * 1e3, 2))
    # the verdict compares whole epochs (every sample once), not 5 single batches: a model
    # whose BatchNorm sees batches of 2 in training mode swings 0..9 from batch to batch
    # (PP-OCR cls), and 5-step means then say nothing (2.98505 vs 2.98502 while it trains)
    row.update(loss_first_epoch=float(np.mean(hist[:BATCHES_PER_EPOCH])),
               loss_last_epoch=float(np.mean(hist[-BATCHES_PER_EPOCH:])))
    row["falling"] = bool(row["loss_last_epoch"] < row["loss_first_epoch"])
    return row


def sweep_model(path, timeout, batch_size=None) -> dict:
    rng = np.random.default_rng(0)
    model = onnx.load(path)
    entry = {"model": os.path.relpath(path, ROOT), "opset": next((o.version for o in model.opset_import
                                                                   if o.domain in ("", "ai.onnx")), None)}
    try:
        batch, shapes, out_shape = probe(path, model, rng, batch_size)
    except RuntimeError as e:  # no data to train on; still ask train-graph what it makes of the model
        work = tempfile.mkdtemp(prefix="train_real_")
        rc, out, _ = run(graphmp_cmd() + ["train-graph", path, "-o", os.path.join(work, "run"), "--precision",
                                          "fp32", "--loss", "mse"], timeout)
        shutil.rmtree(work, ignore_errors=True)
        entry.update(rows=[], error=f"{e}; train-graph (fp32, mse, no --shapes): "
                                    f"{'built' if rc == 0 else one_line(out)}")
        return entry
    loss, flags = pick_loss(out_shape)
    n = batch * BATCHES_PER_EPOCH
    work = tempfile.mkdtemp(prefix="train_real_")
    try:
        data = random_inputs(model, shapes, n, rng)
        data["labels"] = labels_for(loss, out_shape, n, rng)
        np.savez(os.path.join(work, "data.npz"), **data)
        lab = ["N"] + [str(d) for d in (out_shape[1:] if loss == "mse" else out_shape[1:2] if flags else [])]
        plan = {"batch": batch, "shapes": shapes, "loss": loss, "flags": list(flags), "retry_flags": [], "n": n,
                "data": os.path.join(work, "data.npz"), "label_shape": ",".join(lab)}
        entry.update(batch=batch, shapes=shapes, output_shape=out_shape, loss=loss)
        entry["rows"] = [sweep_one(path, p, plan, work, timeout) for p in ("fp32", "mixed")]
        entry["flags"] = plan["flags"] + plan["retry_flags"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return entry


def table(results) -> str:
    head = f"{'model':34} {'loss':13} {'prec':5} {'built':5} {'first5':>10} {'last5':>10} {'epoch1':>10} {'epochN':>10} "
    head += f"{'fall':>4} {'skip':>4} {'ms/step':>9}"
    lines = [head, "-" * len(head)]
    for e in results:
        name = e["model"].replace("models/", "")
        if e.get("same_as"):
            lines.append(f"{name:34} (byte-identical to {e['same_as']})")
            continue
        if not e.get("rows"):
            lines.append(f"{name:34} not run: {e.get('error')}")
            continue
        loss = e["loss"] + (" ax-1" if "--class-axis" in e.get("flags", []) else "")
        for r in e["rows"]:
            if not r["built"] or not r.get("trained"):
                what = "no" if not r["built"] else "yes"
                lines.append(f"{name:34} {loss:13} {r['precision']:5} {what:5} {r.get('error', '')}")
            else:
                lines.append(f"{name:34} {loss:13} {r['precision']:5} {'yes':5} {r['loss_first5']:10.4g} "
                             f"{r['loss_last5']:10.4g} {r['loss_first_epoch']:10.4g} {r['loss_last_epoch']:10.4g} "
                             f"{'yes' if r['falling'] else 'NO':>4} {r['skipped']:4d} {r['ms_per_step']:9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", help="only these file names (comma separated, e.g. mnist_cntk,resnet)")
    ap.add_argument("--batch", type=int, help="batch size for models with a free batch axis (default 2, else 1)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per CLI command (default 420)")
    ap.add_argument("--dir", action="append", help="sweep the .onnx files of this folder instead of models/ "
                    "(repeatable), e.g. models fetched by `python models/corpus.py --dest DIR`")
    args = ap.parse_args(argv)
    want = set(args.models.split(",")) if args.models else None
    seen, results = {}, []
    for d in args.dir or DIRS:
        for path in sorted(glob.glob(os.path.join(ROOT, d, "*.onnx"))):
            name = os.path.splitext(os.path.basename(path))[0]
            if want and name not in want:
                continue
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            rel = os.path.relpath(path, ROOT)
            if digest in seen:
                results.append({"model": rel, "same_as": seen[digest]})
            else:
                seen[digest] = rel
                results.append(sweep_model(path, args.timeout, args.batch))
            print(table(results[-1:]).splitlines()[-1] if not results[-1].get("rows") else
                  "\n".join(table(results[-1:]).splitlines()[2:]), flush=True)
            if args.json:  # written as it goes: a long sweep keeps what it has
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
