"""Training / eval data for graphmp.train.loop: loading, batching and checks before use.

- make_source(): an .npz path or a dict of arrays (a Dataset: checked once when loaded,
  batched in a seeded order per epoch) or a re-iterable of batch dicts (a BatchIterable:
  each batch checked as it comes); names, per-sample shapes and dtypes conformed to the
  step graph (lossless casts only).
- label_rule(): what a valid cross-entropy label is for a run (class axis, class count,
  ignore index), read from train.json's config with defaults, so runs made before those
  keys existed still work.
- check_labels(): every label is a class index in [0, num_classes) or the ignore index;
  otherwise one GraphmpError naming the data, the array, the bad value and its position.
  Without the check, label -1 trains silently as the last class (the loss's GatherElements
  wraps negative indices) and label >= classes is a raw runtime error.
- nonfinite_samples(): which samples hold NaN/inf in a float array, so that bad input data
  is reported as such (not as "inf/NaN gradients" many steps later) or dropped on request.
- whole_arrays(): inputs without a batch axis -- scalars, an RNN's initial state [layers,
  batch, hidden] beside a batch-first input -- which the data gives whole: once (fed with
  every batch) or once per sample; labels of an output with no batch axis, once per sample.
- run_failure(): an ONNX Runtime run that failed on data the checks let through, as one
  GraphmpError naming the data, the mismatching input and what to do.

Each check is one vectorised pass (np.isfinite / comparisons) over the arrays: a dataset is
checked once when loaded, an iterable of batches batch by batch as it is assembled.
"""
from __future__ import annotations

import copy

import os
import re

import numpy as np
import onnx

from ..errors import GraphmpError
from ..model_io import load_npz
from .losses import MSE_RESHAPE
from .runfiles import run_file


def label_rule(run_dir, meta: dict) -> dict | None:
    """{'name', 'axis', 'num_classes', 'ignore_index'} for a cross-entropy run, None otherwise.

    Needs: meta = train.json of run_dir. axis is the class axis of the model output
    (config 'class_axis', default 1); num_classes comes from config 'num_classes' or, when
    absent, from the static size of that axis of the model output in infer.onnx (None when
    it is symbolic: then only negative labels can be checked)."""
    cfg = meta.get("config", {})
    if cfg.get("loss") != "cross-entropy":
        return None
    axis = int(cfg.get("class_axis", 1))
    num = cfg.get("num_classes")
    if num is None:
        num = _static_class_count(run_file(run_dir, meta, "infer_model"), meta["model_output"], axis)
    ignore = cfg.get("ignore_index")
    return {"name": meta["label"]["name"], "axis": axis, "num_classes": None if num is None else int(num),
            "ignore_index": None if ignore is None else int(ignore)}


def _static_class_count(infer_path: str, output: str, axis: int) -> int | None:
    """Size of `axis` of tensor `output` in the model at infer_path, when it is a fixed number."""
    try:
        m = onnx.load(infer_path, load_external_data=False)
    except Exception:  # noqa: BLE001 - the count is optional; load_run already checked the file exists
        return None
    vi = next((v for v in list(m.graph.output) + list(m.graph.value_info) if v.name == output), None)
    if vi is None:
        try:
            inferred = onnx.shape_inference.infer_shapes(m)
        except Exception:  # noqa: BLE001
            return None
        vi = next((v for v in list(inferred.graph.output) + list(inferred.graph.value_info) if v.name == output),
                  None)
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims = vi.type.tensor_type.shape.dim
    if not -len(dims) <= axis < len(dims):
        return None
    d = dims[axis]
    return int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None


def check_labels(labels: np.ndarray, rule: dict | None, where: str, first_axis: str = "sample") -> None:
    """Raise a one-line GraphmpError if some label is not a valid class index for `rule`.

    labels: integer array, first axis = samples (first_axis names it in the message, e.g.
    "sample" or "sample of this batch"). Valid: 0 <= label < num_classes (upper bound only
    when known), or label == ignore_index."""
    if rule is None or labels.size == 0:
        return
    t = np.asarray(labels)
    bad = t < 0
    if rule["num_classes"] is not None:
        bad |= t >= rule["num_classes"]
    if rule["ignore_index"] is not None:
        bad &= t != rule["ignore_index"]
    if not bad.any():
        return
    flat = int(np.flatnonzero(bad)[0])
    pos = np.unravel_index(flat, t.shape)
    value = int(t[pos])
    at = f"{first_axis} {pos[0]}" + (f", element {tuple(int(i) for i in pos)}" if t.ndim > 1 else "")
    allowed = (f"0 <= label < {rule['num_classes']} (the model output has {rule['num_classes']} classes on "
               f"axis {rule['axis']})" if rule["num_classes"] is not None else "labels >= 0")
    ignore = (f" or the ignore index {rule['ignore_index']}" if rule["ignore_index"] is not None
              else "; for padding labels build the run with an ignore index (e.g. --ignore-index -100)"
              if value < 0 else "")
    raise GraphmpError(f"{where}: '{rule['name']}' holds label {value} at {at} ({int(bad.sum())} bad label(s) "
                       f"in all); cross-entropy needs {allowed}{ignore}. Fix the labels.")


def nonfinite_samples(arrays: dict) -> tuple[np.ndarray | None, dict]:
    """(bool mask over the first axis: sample holds NaN/inf in some float array, or None when
    every value is finite; {array name: (non-finite values, first bad sample index)})."""
    mask, found = None, {}
    for name, a in arrays.items():
        if a.dtype.kind != "f" or a.ndim == 0:
            continue
        fin = np.isfinite(a)
        if fin.all():
            continue
        rows = ~fin.reshape(len(a), -1).all(axis=1)
        found[name] = (int(fin.size - np.count_nonzero(fin)), int(np.flatnonzero(rows)[0]))
        mask = rows if mask is None else mask | rows
    return mask, found


def describe_nonfinite(found: dict, mask: np.ndarray, where: str, first_axis: str = "sample") -> str:
    """The one-line message for nonfinite_samples' result."""
    parts = [f"'{n}' has {c} NaN/inf value(s), first at {first_axis} {i}" for n, (c, i) in found.items()]
    return (f"{where}: the input data is not finite: {'; '.join(parts)} ({int(mask.sum())} of {len(mask)} "
            "samples affected). Clean the data, or pass --skip-bad-samples (skip_bad_samples=True) to drop "
            "those samples.")


class DataCheck:
    """The checks above applied to arrays as they are loaded or batched (first axis = samples).

    Non-finite samples raise a GraphmpError, or with skip=True are dropped and counted in
    .dropped; then the labels are checked against `rule` (label_rule(); None = no check)."""

    def __init__(self, rule: dict | None, skip: bool = False):
        self.rule, self.skip, self.dropped = rule, bool(skip), 0

    def __call__(self, arrays: dict, where: str, first_axis: str = "sample", constants: dict | None = None) -> dict:
        """arrays: first axis = samples; constants: arrays fed whole (only their labels checked)."""
        mask, found = nonfinite_samples(arrays)
        if mask is not None:
            if not self.skip:
                raise GraphmpError(describe_nonfinite(found, mask, where, first_axis))
            self.dropped += int(mask.sum())
            arrays = {k: v[~mask] for k, v in arrays.items()}
        if self.rule is not None:
            name = self.rule["name"]
            check_labels(arrays[name] if name in arrays else constants[name], self.rule, where, first_axis)
        return arrays


# --- loading and batching ------------------------------------------------------------------

def _expected(meta) -> dict:
    """{name: (dims, dtype)} of the step inputs a batch must hold."""
    exp = {n: (d, np.dtype(meta["input_types"][n])) for n, d in meta["inputs"].items()}
    lab = meta["label"]
    exp[lab["name"]] = (lab["shape"], np.dtype(lab["dtype"]))
    return exp


STATIC_WHOLE = "the model's inputs all have a fixed first axis, and the data stacks whole inputs, one per sample"
STATIC_ONCE = "the model's inputs all have a fixed first axis, and the data gives this one once, at its exact shape"


def _fits(dims, shape) -> bool:
    return len(shape) == len(dims) and all(not isinstance(d, int) or d == s for d, s in zip(dims, shape))


def whole_arrays(meta, arrays: dict | None = None) -> dict:
    """{model input name: why}: inputs with no batch axis, which the model takes whole.

    Those are scalars and -- when some input has a free first axis (the batch axis) --
    inputs whose first axis is fixed (an RNN's initial state [layers, batch, hidden]). When
    every input's first axis is fixed, the data's rank decides (`arrays`, when given): an
    array with one axis more than the input, the rest of its shape the input's, stacks
    whole inputs one per sample (a streaming model's caches [2, 1, 16, 16, 33] beside its
    frame [1, 257, 1, 2]), and beside such stacked inputs an array of exactly its input's
    shape is given once and fed with every step (a zero initial cache); else the first axis
    is the (fixed) batch axis, as for a batch-1 export. (Labels are whole when the data says
    so: see _label_form.)"""
    inputs = meta["inputs"]
    free = next((n for n, d in inputs.items() if d and not isinstance(d[0], int)), None)
    out = {}
    for name, dims in inputs.items():
        if dims is not None and not dims:
            out[name] = "a scalar"
        elif free and dims and isinstance(dims[0], int):
            out[name] = f"its first axis is fixed at {dims[0]}, while '{free}' has a free batch axis"
        elif not free and dims and arrays is not None and name in arrays \
                and np.ndim(arrays[name]) == len(dims) + 1 and _fits(dims, np.shape(arrays[name])[1:]):
            out[name] = STATIC_WHOLE
    if STATIC_WHOLE in out.values():
        for name, dims in inputs.items():
            if name not in out and dims and name in arrays and _fits(dims, np.shape(arrays[name])):
                out[name] = STATIC_ONCE
    return out


def _label_form(a, dims) -> str | None:
    """'stacked' when the labels are one per sample of an output with no batch axis: the
    label shape is a scalar or starts with a fixed size, and the data has one axis more
    (e.g. --label-shape 4 for an output [4], data [samples, 4]); None for batched labels.
    Exporters name dims freely (the output's batch may be 'unk__3' beside the input's
    'batch'), so the data's rank decides, not the dim names."""
    if dims is None or (dims and not isinstance(dims[0], int)) or a.ndim != len(dims) + 1:
        return None
    return "stacked" if all(not isinstance(d, int) or d == s for d, s in zip(dims, a.shape[1:])) else None


def _check_shape(name, a, dims, where, batched):
    layouts = "" if batched or not dims or not isinstance(dims[0], int) else (
        f"; accepted: [samples, {', '.join(map(str, dims[1:]))}] (axis 0 is the model's batch of {dims[0]}), or "
        f"[samples, {', '.join(map(str, dims))}] for every input (one whole input per sample, batch size 1; "
        f"an input's exact shape {list(dims)} is then also accepted, given once beside stacked inputs)")
    if dims is not None and a.ndim != len(dims):
        raise GraphmpError(f"{where}: '{name}' has shape {a.shape}, the model wants {len(dims)} axes {dims} "
                           f"(first axis = {'batch' if batched else 'samples'}){layouts}.")
    for i, d in enumerate(dims or []):
        if i > 0 and isinstance(d, int) and a.shape[i] != d:
            raise GraphmpError(f"{where}: '{name}' has shape {a.shape}; axis {i} must be {d} (model wants {dims})"
                               f"{layouts}.")


def _whole_form(name, a, dims, why, where, batched) -> str:
    """'const' (the array is the model's input, fed with every batch) or 'stacked' (one per
    sample on a new first axis; not in a batch dict); else a one-line error saying both."""
    if why == STATIC_WHOLE:
        return "stacked"
    if _fits(dims, a.shape):
        return "const"
    if not batched and a.ndim == len(dims) + 1 and _fits(dims, a.shape[1:]):
        return "stacked"
    stacked = "" if batched else f", or one per sample stacked as [samples, {', '.join(map(str, dims))}] (then " \
                                 f"each step takes one sample: batch size 1)"
    raise GraphmpError(f"{where}: '{name}' has shape {list(a.shape)}, but the model takes it whole with no batch "
                       f"axis ({why}): give one array of shape {dims} (fed with every batch){stacked}. For an "
                       "initial state, zeros are the usual choice.")


def _conform(arrays: dict, meta: dict, where: str, batched: bool) -> tuple[dict, dict]:
    """Check names, per-sample shapes and dtypes against the step graph; cast losslessly.

    Returns (arrays with a sample/batch first axis, {name: 'const' | 'stacked'} for the whole
    arrays among them -- see whole_arrays; 'const' ones have no sample axis)."""
    exp = _expected(meta)
    missing = [n for n in exp if n not in arrays]
    if missing:
        extra = sorted(set(arrays) - set(exp))
        what = " (the labels: class indices for cross-entropy, targets for mse)" \
            if meta["label"]["name"] in missing else ""
        raise GraphmpError(f"{where}: missing array(s) {missing}{what}. Expected one array per model input plus "
                           f"the labels: {list(exp)}; found {sorted(arrays)}"
                           + (f" (unused: {extra})" if extra else "") + ".")
    whole = whole_arrays(meta, None if batched else arrays)
    out, forms, n = {}, {}, None
    for name, (dims, dt) in exp.items():
        a = np.asarray(arrays[name])
        if name in whole:
            forms[name] = _whole_form(name, a, dims, whole[name], where, batched)
        elif name == meta["label"]["name"] and not batched and _label_form(a, dims):
            forms[name] = "stacked"
        else:
            _check_shape(name, a, dims, where, batched)
        if forms.get(name) != "const" and a.ndim:
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise GraphmpError(f"{where}: arrays disagree on the number of samples (first axis): '{name}' has "
                                   f"{a.shape[0]}, others {n}.")
        if a.dtype != dt:
            if dt.kind == "i" and a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
                raise GraphmpError(f"{where}: '{name}' must hold integer class indices, got non-integer floats.")
            if dt.kind == "i" and a.dtype.kind not in "iuf" or dt.kind == "f" and a.dtype.kind not in "iuf":
                raise GraphmpError(f"{where}: '{name}' has dtype {a.dtype}; the model wants {dt}.")
            a = a.astype(dt)
        out[name] = a
    return out, forms


def _split_constants(arrays: dict, forms: dict, where: str) -> tuple[dict, dict]:
    """(per-sample arrays, constant arrays); a constant holding NaN/inf is an error (no sample
    to drop: it is in every step)."""
    consts = {k: arrays[k] for k, f in forms.items() if f == "const"}
    for k, a in consts.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise GraphmpError(f"{where}: '{k}' (fed whole with every batch) holds "
                               f"{int(a.size - np.count_nonzero(np.isfinite(a)))} NaN/inf value(s). Fix the data.")
    return {k: v for k, v in arrays.items() if k not in consts}, consts


class Dataset:
    """Arrays with samples on the first axis, batched in a seeded order per epoch.

    Checked once when loaded (check: a DataCheck; samples with NaN/inf dropped when it skips).
    Whole arrays (whole_arrays): a constant one goes into every batch as it is; stacked ones
    (one per sample) make every step one sample (.one_per_step), fed without the sample axis."""

    def __init__(self, data, meta, where, check: DataCheck):
        arrays = load_npz(os.fspath(data)) if isinstance(data, (str, os.PathLike)) else dict(data)
        arrays, forms = _conform(arrays, meta, where, batched=False)
        per_sample, self.constants = _split_constants(arrays, forms, where)
        if not per_sample:
            raise GraphmpError(f"{where}: every array is fed whole; the data holds no samples to train on.")
        self.arrays = check(per_sample, where, constants=self.constants)
        self.stacked = [k for k, f in forms.items() if f == "stacked"]
        self.one_per_step = bool(self.stacked)
        self.n = next(iter(self.arrays.values())).shape[0]
        self.where, self.check = where, check

    def num_batches(self, batch_size, drop_last):
        return self.n // batch_size if drop_last else -(-self.n // batch_size)

    def take(self, idx) -> dict:
        b = {k: v[idx[0]] if k in self.stacked else v[idx] for k, v in self.arrays.items()}
        b.update(self.constants)
        return b

    def batches(self, epoch, batch_size, seed, drop_last, start=0):
        order = np.random.default_rng(seed + epoch).permutation(self.n)
        for i in range(start, self.num_batches(batch_size, drop_last)):
            yield self.take(order[i * batch_size:(i + 1) * batch_size])

    def shard(self, rank: int, n: int) -> "Dataset":
        """Samples rank, rank + n, ... (a data-parallel rank's part of an eval set)."""
        part = copy.copy(self)
        part.arrays = {k: v[rank::n] for k, v in self.arrays.items()}
        part.n = len(range(rank, self.n, n))
        return part

    def sequential(self, batch_size):
        size = 1 if self.one_per_step else batch_size
        for i in range(0, self.n, size):
            yield self.take(np.arange(i, min(i + size, self.n)))


class BatchIterable:
    """A re-iterable of batch dicts (the Python API). Each batch is checked as it comes (check:
    a DataCheck); a batch left without samples, or short of the model's fixed batch size,
    after dropping bad samples is yielded as None (the caller skips it, counting its place).
    Whole arrays (whole_arrays) are given in each batch at the model's shape."""

    def __init__(self, data, meta, check: DataCheck):
        self.data, self.meta, self.check = data, meta, check
        self.n = None
        self.one_per_step = False
        whole = whole_arrays(meta)
        fixed = [d[0] for k, d in meta["inputs"].items() if d and isinstance(d[0], int) and k not in whole]
        self.fixed = fixed[0] if fixed else None
        try:
            self.nb = len(data)
        except TypeError:
            self.nb = None

    def num_batches(self, batch_size, drop_last):
        return self.nb

    def batches(self, epoch, batch_size, seed, drop_last, start=0):
        for i, b in enumerate(self.data):
            if i >= start:
                where = f"batch {i} of epoch {epoch}"
                b, consts = _split_constants(*_conform(b, self.meta, where, batched=True), where)
                k = len(next(iter(b.values())))
                b = self.check(b, where, "sample of this batch", consts)
                n = len(next(iter(b.values())))
                if n == 0 or (n < k and self.fixed is not None):
                    self.check.dropped += n
                    b = None
                yield None if b is None else dict(b, **consts)


def make_source(data, meta, what="data", check: DataCheck | None = None):
    """data (an .npz path, a dict of arrays or an iterable of batch dicts) as a batch source."""
    check = check or DataCheck(None)
    if isinstance(data, (str, os.PathLike, dict)):
        return Dataset(data, meta, os.fspath(data) if isinstance(data, (str, os.PathLike)) else what, check)
    if hasattr(data, "__iter__"):
        return BatchIterable(data, meta, check)
    raise GraphmpError(f"{what} must be an .npz path, a dict of arrays or an iterable of batch dicts, "
                       f"not {type(data).__name__}")


def in_order(src, batch_size):
    """Every sample once, in order (eval); batches dropped whole by the data check are left out."""
    it = src.sequential(batch_size) if isinstance(src, Dataset) else src.batches(0, batch_size, 0, False)
    return (b for b in it if b is not None)


def mse_mismatch(where: str, label: str, got, meta: dict, out_shape=None) -> str:
    """The message for mse labels whose element count differs from the model output's."""
    real = f"computes {list(out_shape)}" if out_shape is not None else "computes another size"
    fix = ",".join(map(str, out_shape)) if out_shape is not None else "<the output's real shape>"
    return (f"{where}: '{label}' has shape {list(got)} in this step, but the model output '{meta['model_output']}' "
            f"{real}, not its declared shape (labels {meta['label']['shape']}); mse needs one target per output "
            f"element. Rebuild the run with `graphmp train-graph ... --label-shape {fix}` and give labels of "
            "that shape.")


def run_failure(err: Exception, sess, batch: dict, where: str, graph: str, meta: dict) -> GraphmpError:
    """The one-line error for an ONNX Runtime run that failed on user data: names `where`
    (the data file or batch), the first batch input whose shape or dtype differs from what
    the session declares (the recurrent sequence length the step was built for, when that
    is it), ONNX Runtime's first line, and what to do."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:240]
    if MSE_RESHAPE in str(err):  # the targets do not fit the output (losses.add_loss)
        lab = meta["label"]["name"]
        want = re.search(r"requested shape:\s*\{([-\d,\s]*)\}", str(err))
        out = [int(x) for x in want.group(1).split(",") if x.strip()] if want else None
        return GraphmpError(mse_mismatch(where, lab, np.shape(batch.get(lab)), meta, out))
    declared = {i.name: i for i in sess.get_inputs()}
    culprit = ""
    for name, value in batch.items():
        d = declared.get(name)
        if d is None:
            continue
        a = np.asarray(value)
        want = d.shape
        if len(want) != a.ndim or any(isinstance(w, int) and w != g for w, g in zip(want, a.shape)):
            culprit = f"input '{name}' has shape {list(a.shape)}, {graph} takes {want}"
            break
        typ = d.type[len("tensor("):-1] if d.type.startswith("tensor(") else d.type
        if typ != {"float32": "float", "float64": "double"}.get(a.dtype.name, a.dtype.name):
            culprit = f"input '{name}' has dtype {a.dtype}, {graph} takes {typ}"
            break
    rec = (meta.get("config") or {}).get("recurrent")
    todo = ("rebuild the run with `graphmp train-graph ... --shapes` at the shapes of your data, or make the "
            "data match" if culprit else "check the data's shapes and dtypes against the model's inputs")
    if rec and culprit:
        lens = sorted({e["sequence_length"] for e in rec})
        todo += (f" (its LSTM/GRU are unrolled at sequence length {', '.join(map(str, lens))}: the step graph "
                 "accepts only that length)")
    return GraphmpError(f"{where}: ONNX Runtime could not run {graph} on this data"
                        f"{' (' + culprit + ')' if culprit else ''}: {first}. To fix: {todo}.")
