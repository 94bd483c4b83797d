"""calibrate: FP32 runs of ONNX Runtime over the calibration batches record max |x| of
every float tensor in every graph, the main graph and If/Loop/Scan bodies alike.

Needs: the prepared model (opset >= 7, canonical) and its proven types (types pass).
Guarantees:
- ranges[(graph key, tensor)] = the largest finite |x| seen on any batch (a body run
  many times counts every iteration; a branch that never ran records nothing);
- shapes[tensor] = the dims of every main-graph float tensor on the batch where it was
  largest (the islands pass prices Casts with them: shape inference loses dims behind a
  computed Reshape, the run does not);
- types that shape inference left unknown in the main graph are proven by the run;
- at least one batch ran, or a GraphmpError that names --shapes / --calibration /
  --no-calibration (generated inputs) or the data file (user data). The one case that
  goes on without ranges: ONNX Runtime cannot load the model at all (a custom op with
  no kernel here); then the report says "skipped" with ORT's reason and a warning.

How: a copy of the model gets max(ReduceMax(x), -ReduceMin(x)) per tensor (one scalar
each and no temporaries, so memory does not grow with the number or size of the
intermediates). A scalar computed in a body reaches the main graph as an extra output
of its If (the other branch outputs -inf), Loop or Scan (one value per iteration).
Without user data, the input shapes come
from graphmp.inputs.find_shapes, whose successful trial runs are the batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..context import FLOAT
from ..errors import GraphmpError, first_line
from ..inputs import dims_text, find_shapes, input_specs, user_batches
from ..model_io import attr_graphs, model_weight_bytes
from ..ir import Names
from ..model_runs import ort_session
from ..input_roles import unknown_periodic
from ..names import shown
from ..run_limits import guarded, model_bytes
from . import PassResult

AUTO_LIMIT = 1 << 30
_CONTROL_FLOW = {"If", "Loop", "Scan"}


@dataclass
class Calibration:
    ranges: dict = field(default_factory=dict)     # (graph key, tensor) -> max |x|
    proven_types: dict = field(default_factory=dict)  # main-graph tensor -> elem type
    report: dict = field(default_factory=dict)
    batches: list = field(default_factory=list)    # the feeds that ran (the search measures on them)
    outputs: list = field(default_factory=list)    # the model's FP32 outputs on the first keep_outputs batches
    shapes: dict = field(default_factory=dict)     # main-graph float tensor -> dims (largest seen)


# --------------------------------------------------------------------------- probe
CHUNK = 256  # main-graph tensors whose ranges (and dims) come back as one output each


class _Probe:
    """Adds the range outputs to a copy of the model.

    Main-graph tensors come back in chunks of CHUNK: for each chunk one FLOAT vector of
    max x, one of min x and one INT64 vector of their dims, each followed by -1
    (`chunks`: [(max output, min output, dims output, [tensor, ...])]; `shape_of[dims
    output]` = the tensors). One output per tensor
    made ONNX Runtime's session set-up and first run super-linear in the number of
    outputs (a 100k-node chain: 563 s). A body tensor's max |x| reaches the main graph as
    an extra output of its If/Loop/Scan: `scalars[output] = (graph key, tensor)`."""

    def __init__(self, model, types):
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.types = types
        self.names = Names(self.model)
        self.scalars: dict = {}     # main-graph output name -> (graph key, tensor)
        self.chunks: list = []      # [(max output, min output, dims output, [tensor, ...])]
        self.shape_of: dict = {}    # main-graph output name -> [tensor, ...] whose dims it carries
        self._pending: list = []    # main-graph (tensor, hi, lo, shape) not yet in a chunk
        g = self.model.graph
        self._flat = self.names.fresh("graphmp_cal_flat")
        self._sep = self.names.fresh("graphmp_cal_sep")
        g.initializer.extend([onnx.numpy_helper.from_array(np.array([-1], np.int64), self._flat),
                              onnx.numpy_helper.from_array(np.array([-1], np.int64), self._sep)])
        for name, key in self._instrument(g, "main"):
            g.output.append(helper.make_tensor_value_info(name, FLOAT, []))
            self.scalars[name] = key

    def _max_abs(self, x) -> tuple[list, str]:
        """(nodes, scalar) for max |x| = max(max x, -min x): two scalar reductions and no
        x-sized temporary (an Abs(x) would double the largest activation's memory)."""
        hi, lo, neg, m = (self.names.fresh(f"{x}__absmax_{k}") for k in ("hi", "lo", "neg", "out"))
        return [helper.make_node("ReduceMax", [x], [hi], name=self.names.fresh("graphmp_cal_max"), keepdims=0),
                helper.make_node("ReduceMin", [x], [lo], name=self.names.fresh("graphmp_cal_min"), keepdims=0),
                helper.make_node("Neg", [lo], [neg], name=self.names.fresh("graphmp_cal_neg")),
                helper.make_node("Max", [hi, neg], [m], name=self.names.fresh("graphmp_cal_absmax"))], m

    def _main_probe(self, x) -> list:
        """Nodes for a main-graph tensor: max x and min x, each a [1] vector (reductions with
        kept dims of x flattened: ONNX Runtime's Reshape aliases its input, no copy, the peak
        memory of a 256 MB activation measured the same), and its Shape; a full chunk is
        concatenated into the outputs right there, so the scalars do not pile up. Four nodes
        per tensor: ONNX Runtime's session set-up grows faster than its node count."""
        flat, hi, lo, s = (self.names.fresh(f"{x}__cal_{k}") for k in ("flat", "hi", "lo", "shape"))
        name = self.names.fresh
        nodes = [helper.make_node("Reshape", [x, self._flat], [flat], name=name("graphmp_cal_flat")),
                 helper.make_node("ReduceMax", [flat], [hi], name=name("graphmp_cal_max"), keepdims=1),
                 helper.make_node("ReduceMin", [flat], [lo], name=name("graphmp_cal_min"), keepdims=1),
                 helper.make_node("Shape", [x], [s], name=name("graphmp_cal_shape"))]
        self._pending.append((x, hi, lo, s))
        return nodes + (self._flush() if len(self._pending) >= CHUNK else [])

    def _flush(self) -> list:
        """Concat nodes (and graph outputs) for the pending main-graph tensors."""
        if not self._pending:
            return []
        tensors = [p[0] for p in self._pending]
        g, name = self.model.graph, self.names.fresh
        hi, lo, dims = name("graphmp_cal_hi"), name("graphmp_cal_lo"), name("graphmp_cal_dims")
        nodes = [helper.make_node("Concat", [p[1] for p in self._pending], [hi], name=name("graphmp_cal_cat"), axis=0),
                 helper.make_node("Concat", [p[2] for p in self._pending], [lo], name=name("graphmp_cal_cat"), axis=0),
                 helper.make_node("Concat", [y for p in self._pending for y in (p[3], self._sep)], [dims],
                                  name=name("graphmp_cal_cat"), axis=0)]
        g.output.extend([helper.make_tensor_value_info(hi, FLOAT, [len(tensors)]),
                         helper.make_tensor_value_info(lo, FLOAT, [len(tensors)]),
                         helper.make_tensor_value_info(dims, onnx.TensorProto.INT64, [None])])
        self.chunks.append((hi, lo, dims, tensors))
        self.shape_of[dims] = tensors
        self._pending = []
        return nodes

    def _instrument(self, g, key) -> list:
        """[(scalar name in g, (graph key, tensor))] for the float tensors of g's bodies
        (nested), surfaced through their nodes' outputs, and for g's own float tensors
        unless g is the main graph (those go to the chunks). Each tensor's reductions come
        right after its producer in the node list, so ONNX Runtime can free the tensor early
        instead of keeping every intermediate alive until reductions placed at the end ran."""
        types = self.types.get(key, {})
        inits = {t.name for t in g.initializer}
        found, order = [], []

        def probe(x):
            if key == "main":
                order.extend(self._main_probe(x))
                return
            nodes, m = self._max_abs(x)
            order.extend(nodes)
            found.append((m, (key, x)))
        for v in g.input:
            if v.name not in inits and types.get(v.name) == FLOAT:
                probe(v.name)
        surfaced = []
        for n in list(g.node):
            order.append(n)
            for o in n.output:
                if o and types.get(o) == FLOAT:
                    probe(o)
            if n.op_type in _CONTROL_FLOW and n.domain in ("", "ai.onnx"):
                surfaced.extend(self._surface(g, n, key))
        if key == "main":
            order.extend(self._flush())
        del g.node[:]  # the references in `order` stay valid (protobuf detaches removed messages)
        g.node.extend(order)
        return found + surfaced

    def _surface(self, g, n, key) -> list:
        subs = [(a, sg) for a in n.attribute for sg in attr_graphs(a)]
        per_sub = [(a.name, sg, self._instrument(sg, f"{key}/{n.name}.{a.name}")) for a, sg in subs]
        out = []
        if n.op_type == "If":
            union = [k for _, _, found in per_sub for _, k in found]
            for _, sg, found in per_sub:
                mine = dict((k, x) for x, k in found)
                for k in union:
                    x = mine.get(k)
                    if x is None:  # not computed in this branch: -inf means "nothing seen"
                        x = self.names.fresh("graphmp_cal_none")
                        sg.node.append(helper.make_node("Constant", [], [x], name=self.names.fresh("graphmp_cal_c"),
                                                        value=onnx.numpy_helper.from_array(np.array(-np.inf, np.float32))))
                    sg.output.append(helper.make_tensor_value_info(x, FLOAT, []))
            keys = union
        else:  # Loop / Scan: each body scalar becomes a scan output (one value per iteration)
            keys = []
            for _, sg, found in per_sub:
                for x, k in found:
                    sg.output.append(helper.make_tensor_value_info(x, FLOAT, []))
                    keys.append(k)
            for a in n.attribute:
                if a.name in ("scan_output_axes", "scan_output_directions"):
                    a.ints.extend([0] * len(keys))
        for k in keys:
            y = self.names.fresh(f"{n.name}__cal")
            n.output.append(y)
            out.append((y, k))
        return out


# --------------------------------------------------------------------------- runs
class _Runner:
    """Runs the probe and folds each successful run into the ranges."""

    def __init__(self, sess, probe: _Probe, cal: Calibration, model_outputs: list, keep_outputs: int, guard):
        self.sess, self.probe, self.cal, self.guard = sess, probe, cal, guard
        self.model_outputs, self.keep_outputs = model_outputs, keep_outputs
        self.outputs = [o.name for o in sess.get_outputs()]
        self.inputs = [i.name for i in sess.get_inputs()]
        self.shapes: list = []
        self.on_batch = None  # called after each batch that ran (the progress line)

    def __call__(self, feeds):
        chosen = {k: feeds[k] for k in self.inputs}
        outs = self.guard(lambda options: self.sess.run(self.outputs, chosen, options))  # graphmp.run_limits
        got = dict(zip(self.outputs, outs))
        ranges = self.cal.ranges
        for hi, lo, dims, tensors in self.probe.chunks:
            self._note_shapes(tensors, got[dims])
            m = np.maximum(np.asarray(got[hi], np.float64), -np.asarray(got[lo], np.float64))
            for x, v in zip(tensors, m.tolist()):  # an empty tensor: -inf, nothing seen
                if v == v and v > ranges.get(("main", x), -np.inf):  # v == v: not NaN
                    ranges[("main", x)] = v
        for name, key in self.probe.scalars.items():
            arr = got.get(name)
            if not isinstance(arr, np.ndarray) or arr.size == 0:
                continue
            finite = arr[~np.isnan(arr)]
            m = float(finite.max()) if finite.size else -np.inf
            if m > ranges.get(key, -np.inf):
                ranges[key] = m
        self.shapes.append(", ".join(f"{k}:{dims_text(np.shape(feeds[k]))}" for k in self.inputs))
        if len(self.cal.outputs) < self.keep_outputs:  # the search's FP32 references: no second run
            self.cal.outputs.append({k: got[k] for k in self.model_outputs})
        self.cal.batches.append({k: feeds[k] for k in self.inputs})
        if self.on_batch is not None:
            self.on_batch()

    def _note_shapes(self, tensors, arr):
        """The dims of `tensors`, concatenated in order, each followed by -1."""
        flat = np.asarray(arr).ravel().tolist()
        start = 0
        for x in tensors:
            end = flat.index(-1, start)
            dims = tuple(int(d) for d in flat[start:end])
            start = end + 1
            old = self.cal.shapes.get(x)
            if old is None or math.prod(dims) > math.prod(old):
                self.cal.shapes[x] = dims


_ORT_TYPES = {f"tensor({k})": v for k, v in (
    ("float", onnx.TensorProto.FLOAT), ("float16", onnx.TensorProto.FLOAT16), ("double", onnx.TensorProto.DOUBLE),
    ("bfloat16", onnx.TensorProto.BFLOAT16), ("int8", onnx.TensorProto.INT8), ("uint8", onnx.TensorProto.UINT8),
    ("int16", onnx.TensorProto.INT16), ("uint16", onnx.TensorProto.UINT16), ("int32", onnx.TensorProto.INT32),
    ("uint32", onnx.TensorProto.UINT32), ("int64", onnx.TensorProto.INT64), ("uint64", onnx.TensorProto.UINT64),
    ("bool", onnx.TensorProto.BOOL), ("string", onnx.TensorProto.STRING))}


def _ort_types(model, types, base_dir) -> dict:
    """Element types of the main-graph tensors that shape inference left unknown (old
    opsets, custom ops), as ONNX Runtime infers them when it builds a session, with no
    run: a float one then gets its range reduction in the graph like any other, instead
    of being returned whole (a full activation per tensor, hundreds of MB at 720 px)."""
    main = types.get("main", {})
    g = model.graph
    have = {o.name for o in g.output}
    unknown = list(dict.fromkeys(o for n in g.node for o in n.output if o and o not in have and main.get(o) is None))
    if not unknown:
        return {}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.extend(onnx.ValueInfoProto(name=o) for o in unknown)
    sess = ort_session(m, base_dir=base_dir, optimize=False)
    return {o.name: _ORT_TYPES[o.type] for o in sess.get_outputs() if o.name in unknown and o.type in _ORT_TYPES}


def calibrate(model, types, *, data=None, shapes=None, base_dir=None, where="<model>",
              keep_outputs: int = 0, on_batch=None) -> Calibration:
    """Ranges of every float tensor over the calibration batches (see the module doc).

    data: None/"auto" (generated inputs), "off", or .npz path(s) / dicts of arrays.
    shapes: --shapes for generated inputs (NAME:DIMS,... or a dict).
    Generated inputs make two batches: a second one costs a full run of the model but
    sees more (on PP-OCRv4's detector a tensor passed the range threshold only in the
    second batch, 515.8 vs 512), and the search uses it as its held-out batch.
    keep_outputs: the model's own outputs of the first this many batches are kept in
    cal.outputs (the probe runs unoptimised, as the search's references must).
    on_batch: called with no argument after each batch that ran (a progress line)."""
    cal = Calibration()
    if data == "off":
        cal.report = {"source": "off", "batches": 0}
        return cal
    generated = data in (None, "auto")
    if generated and model_weight_bytes(model) > AUTO_LIMIT:
        cal.report = {"source": "skipped: model over 1 GB (pass --calibration DATA to range-check it)",
                      "batches": 0}
        return cal
    try:
        cal.proven_types = _ort_types(model, types, base_dir)
        if cal.proven_types:
            types = dict(types, main={**types.get("main", {}), **cal.proven_types})
        probe = _Probe(model, types)
        sess = ort_session(probe.model, base_dir=base_dir, optimize=False, in_node_order=True)
    except Exception as e:  # noqa: BLE001 - ORT's load errors are many kinds
        reason = first_line(e)
        cal.report = {"source": f"skipped: ONNX Runtime cannot load the model here ({reason})", "batches": 0,
                      "warning": "no range check was done: nodes that overflow FP16 were not found"}
        return cal
    del probe.model
    guard = guarded(f"{shown(where, 300)}: calibration", model_bytes(model))
    run = _Runner(sess, probe, cal, [o.name for o in model.graph.output], keep_outputs, guard)
    run.on_batch = on_batch
    specs = input_specs(model)
    if generated:
        plan = find_shapes(model, run, shapes, where=where)
        try:
            if plan.trials == 0:  # every size given or fixed: nothing was tried yet
                run(plan.feeds(seed=0))
            if not plan.batch_free:
                run(plan.feeds(seed=1))
        except Exception as e:  # noqa: BLE001 - ORT's run errors are many kinds
            raise GraphmpError(f"{where}: ONNX Runtime cannot run the model on inputs of shapes {plan.describe()} "
                               f"({plan.how}): {first_line(e)}. Give other --shapes, or real data with "
                               "--calibration") from None
        cal.report = {"source": "generated inputs", "shapes_found": plan.how, "value_hints": plan.hints}
    else:
        for source, arrays in user_batches(data, specs, "--calibration"):
            try:
                run(arrays)
            except Exception as e:  # noqa: BLE001
                raise GraphmpError(f"{source}: ONNX Runtime cannot run the FP32 model on this data "
                                   f"({first_line(e)})") from None
        cal.report = {"source": "user data"}
    cal.report.update(batches=len(run.shapes), shapes=run.shapes, tensors_observed=len(cal.ranges),
                      types_proven_by_run=len(cal.proven_types))
    return cal


def run(ctx) -> PassResult:
    """Needs the prepared model and ctx.types. Sets ctx.ranges, ctx.shapes, ctx.batches and
    (for the search, --plan and the islands' trials) ctx.batch_outputs; proves unknown
    main-graph types."""
    from .islands import trials_wanted
    from .search import MAX_SEARCH_BATCHES
    wants_references = (ctx.options.max_error is not None or ctx.options.plan is not None  # search / plan verify
                        or trials_wanted(ctx))                                           # the islands' trials
    with ctx.progress("calibration: batches") as bar:
        cal = calibrate(ctx.model, ctx.types, data=ctx.options.calibration, shapes=ctx.options.shapes,
                        base_dir=ctx.base_dir, where=ctx.path,
                        keep_outputs=MAX_SEARCH_BATCHES + 1 if wants_references else 0, on_batch=bar.update)
    ctx.ranges = cal.ranges
    ctx.shapes = cal.shapes
    ctx.batches = cal.batches
    ctx.batch_outputs = cal.outputs
    if cal.report.get("warning"):
        ctx.warn(f"calibration {cal.report['source']}: {cal.report['warning']}")
    if ctx.options.shapes and ctx.options.calibration not in (None, "auto", "off"):
        ctx.warn("--shapes is not used: the --calibration batches give the input shapes (--shapes sizes "
                 "generated inputs only)")
    if cal.report["source"] == "generated inputs":
        ctx.warn("calibration ran on generated inputs (floats ~N(0,1)): nodes that overflow FP16 only on larger real "
                 "inputs (int16-scale audio, 0-255 pixels, unnormalised features) were not found; for a model fed "
                 "such data, pass --calibration with real batches")
    unknown = unknown_periodic(cal.report.get("value_hints") or {})
    if unknown:
        ctx.warn(f"input(s) {', '.join(repr(n) for n in unknown)} reach a Sin/Cos (a positional or Fourier encoding), "
                 "and graphmp cannot tell their real range from their name: generated N(0,1) values may stay far below "
                 "it, so the periodic rule may leave the encoding FP16 where real inputs need FP32; pass --calibration "
                 "with real batches")
    main = ctx.types.setdefault("main", {})
    for name, elem in cal.proven_types.items():
        main.setdefault(name, elem)
    return PassResult(changed=False, details=cal.report)
