"""The update phase of the training step (build_step's last graph phases), over flat buffers.

From the backward's scaled gradients to the step graph's outputs, for the whole set of
weights at once (graphmp.train.flat holds the layout):
    flat__grad = Concat(raveled gradients, scaled by S)      no pass of its own for 1 / S:
    [accumulation: flat__accum]  flat__grad * (1 / S) added  the optimizer's scalars carry it
                                 to it, one Div, one Where
    all_finite = no inf/NaN in flat__grad and the loss        ONE finite check
    [clipping: one global norm, a scalar factor]              no pass: the scalars carry it
    SGD / AdamW on flat__weights and the flat moments:
    g' = Where(applied, g, 0)                                 ONE select, against a scalar
    X__next = the optimizer's new X, its scalar coefficients   no select per buffer: a skipped
              gated by `applied` (optim.optimizer)              step's coefficients keep X as is
    flat__bn_stats__next = Where(finite, Concat(new running statistics), flat__bn_stats)
The node count of this phase does not grow with the number of weights, except for a Reshape
(a view, no copy) per tensor that is not 1-D around the Splits and Concats that unpack and
pack them (the buffers are cut along rows of flat.ALIGN elements, with a tail for the tensors
of other sizes: graphmp/train/flat.py says why).

The select is one Where on the gradient, then arithmetic: with the gradient 0 on a skipped
step, coefficients of 1 (kept) and 0 (moved) leave every buffer equal to its input (m * 1 +
0 * 0, w - x * 0), and the NaN of an overflowed gradient never reaches the state. A Where
per buffer (weights and each moment, as before) selected between two whole buffers, ORT
CPU's slowest form of Where (8.8 ms for 11.7M floats, 1 thread, against 5.0 for the
gradient's Where with a scalar 0 and 3.7 for a Mul): three of them were 28 of the 97 ms of
ResNet-18's update (benchmarks/train_profile.py). One `If` for all buffers measured no
faster for a ResNet-50 step (benchmarks/README.md), needs the flag on the host mid-graph
(CUDA waits for it) and cannot be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper

from ..errors import GraphmpError
from . import flat as fl
from . import optim
from .builder import Builder, all_names
from .optim import ACCUM, ACCUM_COUNT

NEXT = "__next"
GRAD = "__grad"
STEP = "optimizer_step"
SCALE = "loss_scale"
CLEAN = "loss_scale_clean_steps"
FINITE = "all_finite"
PREFIX = "update"  # the update phase's node names start with it


@dataclass
class State:
    """The step graph's state: (name, kind) pairs, their initial values, counts for train.json."""
    dynamic: bool               # dynamic loss scaling (SCALE, CLEAN are state)
    n_before: int               # nodes of the forward + loss, before the backward
    scale: str = SCALE          # the loss scale's tensor (a constant when static)
    pairs: list = field(default_factory=list)        # logical (per-tensor) state, train.json "state"
    init: dict = field(default_factory=dict)         # its initial values (state.npz)
    graph_pairs: list = field(default_factory=list)  # the step graph's own state (buffers, scalars)
    flat: dict = field(default_factory=dict)         # train.json "flat"
    n_update: int = 0                                # nodes the update phase added


def _flat_name(_: str, suffix: str) -> str:
    """A moment of the flat weights: flat__exp_avg, flat__momentum, ..."""
    return fl.FLAT + suffix


def _moment_suffixes(cfg: dict) -> list:
    if cfg["optimizer"] == "sgd":
        return ["__momentum"] if cfg["momentum"] else []
    return ["__exp_avg", "__exp_avg_sq"]


def _refuse_reserved(model, path: str) -> None:
    taken = set(fl.FLAT_BUFFERS + (fl.GRAD,)) & all_names(model)
    if taken:
        raise GraphmpError(f"{path}: the model already has a tensor named '{sorted(taken)[0]}', which the step "
                           "graph needs.")


def add_update(model, cfg: dict, loss_t: str, weights: list, bn: dict, grads_scaled: dict, st: State,
               shapes: dict, path: str) -> None:
    """Needs the step graph after the backward (weights and BN statistics still graph inputs),
    the loss, {weight: its gradient scaled by S}, {BN statistic: its updated value} and
    {tensor: shape}. Adds the flat update and its state buffers and makes the weights and BN
    statistics views of their buffers; fills st.pairs (the logical state, in the order
    train.json "state" always listed it), st.graph_pairs, st.flat (the packing table) and
    st.n_update. st.init is the caller's (initial_state)."""
    _refuse_reserved(model, path)
    n0 = len(model.graph.node)
    b = Builder(model, prefix=PREFIX)
    table = fl.layout(fl.rows_first([(w, shapes[w]) for w in weights], fl.ALIGN), fl.ALIGN)
    g = fl.flatten_concat(b, [grads_scaled[w] for w, _, _ in table], table, fl.ALIGN, out=fl.GRAD)
    new, applied, finite, kinds = _update(b, cfg, g, loss_t, st)
    # a moment or accumulation buffer holds w + its suffix at the weight's place
    tables = {name: [[w + name[len(fl.FLAT):], off, shape] for w, off, shape in table]
              for name, kind in kinds.items() if kind != "weight"}
    tables[fl.WEIGHTS] = table
    if bn:
        tables[fl.BN_STATS] = fl.layout(fl.rows_first([(r, shapes[r]) for r in bn], fl.ALIGN), fl.ALIGN)
        kinds[fl.BN_STATS] = "bn"
        new[fl.BN_STATS] = fl.flatten_concat(b, [bn[r] for r, _, _ in tables[fl.BN_STATS]], tables[fl.BN_STATS],
                                             fl.ALIGN)
    for name, kind in kinds.items():
        if kind == "accum":  # accumulate()'s next value already holds the window logic
            b.op("Identity", [new[name]], out=name + NEXT)
        elif kind == "bn":  # BN statistics follow each finite forward
            b.op("Where", [finite, new[name], name], out=name + NEXT)
        # weights and moments: the optimizer wrote name + NEXT, gated by its coefficients
    b.op("Where", [applied, new[STEP], STEP], out=STEP + NEXT)
    size = fl.buffer_size(table, fl.ALIGN)
    for name, kind in kinds.items():
        if kind in ("moment", "accum"):
            model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [size]))
    if cfg["grad_accum"] > 1:
        b.op("Identity", [new[ACCUM_COUNT]], out=ACCUM_COUNT + NEXT)
        model.graph.input.append(helper.make_tensor_value_info(ACCUM_COUNT, TensorProto.INT64, []))
    _set_pairs(st, cfg, weights, list(bn), kinds, tables)
    fl.add_views(model.graph, fl.WEIGHTS, table, PREFIX, fl.ALIGN)
    if bn:
        fl.add_views(model.graph, fl.BN_STATS, tables[fl.BN_STATS], PREFIX, fl.ALIGN)
    st.n_update = len(model.graph.node) - n0


def _set_pairs(st: State, cfg: dict, weights: list, bn_stats: list, kinds: dict, tables: dict) -> None:
    """st.pairs (the logical state in the order train.json always listed it), st.graph_pairs
    (the buffers, then the scalars) and st.flat (train.json "flat")."""
    sfx = _moment_suffixes(cfg)
    accum = cfg["grad_accum"] > 1
    st.pairs = ([(w, "weight") for w in weights] + [(w + s, "moment") for w in weights for s in sfx]
                + [(r, "bn") for r in bn_stats] + [(STEP, "counter")])
    order = [fl.WEIGHTS] + [fl.FLAT + s for s in sfx] + ([fl.BN_STATS] if bn_stats else [])
    st.graph_pairs = [(n, kinds[n]) for n in order] + [(STEP, "counter")]
    if accum:
        st.pairs += [(w + ACCUM, "accum") for w in weights] + [(ACCUM_COUNT, "counter")]
        st.graph_pairs += [(fl.FLAT + ACCUM, "accum"), (ACCUM_COUNT, "counter")]
    if st.dynamic:
        st.pairs += [(SCALE, "scale"), (CLEAN, "counter")]
        st.graph_pairs += [(SCALE, "scale"), (CLEAN, "counter")]
    st.flat = {"state": [{"input": n, "output": n + NEXT, "kind": k} for n, k in st.graph_pairs],
               "buffers": {n: tables[n] for n, _ in st.graph_pairs if n in tables}, "grad": fl.GRAD,
               "align": fl.ALIGN}


def _update(b: Builder, cfg: dict, g: str, loss_t: str, st: State):
    """Accumulation, finiteness, clipping, schedule, optimizer and loss-scale update on the flat
    gradient g. Returns ({state: new value} (the weights and moments already gated and written
    to their X__next outputs; the step and accumulation ungated), the `applied` flag gating
    them, this run's finite flag (gates BN statistics), {buffer: kind} of the weights, moment
    and accumulation buffers)."""
    n = cfg["grad_accum"]
    # times 1/S rather than / S: ORT CPU's Div over a whole buffer took 7.3 ms where a Mul takes
    # 2.5 (ResNet-18, 11.7M weights, 1 thread); for a power-of-two S (every dynamic scale from a
    # power-of-two start) the two are the same bits
    unscale = b.op("Reciprocal", [st.scale])
    kinds = {fl.WEIGHTS: "weight"}
    nxt = {}
    if n > 1:  # the window sums unscaled gradients (S may change between windows)
        g, unscale = b.op("Mul", [g, unscale]), None
        micro_finite = optim.finite_flag(b, [g, loss_t])
        grads, update, nxt = optim.accumulate(b, {fl.WEIGHTS: g}, n, state_name=_flat_name)
        window_finite = optim.finite_flag(b, [grads[fl.WEIGHTS], loss_t])
        applied = b.op("And", [update, window_finite])
        # FINITE = update ? window_finite : micro_finite (ORT has no bool Where kernel)
        b.op("Or", [applied, b.op("And", [b.op("Not", [update]), micro_finite])], out=FINITE)
        kinds[fl.FLAT + ACCUM] = "accum"
    else:
        grads = {fl.WEIGHTS: g}
        applied = micro_finite = optim.finite_flag(b, [g, loss_t], out=FINITE, row=fl.ALIGN)
    if cfg["clip_norm"] is not None:
        coef = optim.clip_coef(b, grads, cfg["clip_norm"], unscale)
        unscale = coef if unscale is None else b.op("Mul", [coef, unscale])
    step_next = b.op("Add", [STEP, b.const(1, np.int64)])
    lr = optim.lr_tensor(b, cfg, STEP)
    new, moments = optim.optimizer(b, cfg, optim.gated_grads(b, grads, applied), lr,
                                   b.op("Cast", [step_next], to=TensorProto.FLOAT), applied,
                                   state_name=_flat_name, out_name=lambda state: state + NEXT, grad_scale=unscale)
    kinds.update({m: "moment" for m in moments})
    new[STEP] = step_next
    new.update(nxt)
    if st.dynamic:
        s_new, c_new = optim.scale_update(b, cfg, micro_finite if n == 1 else window_finite, SCALE, CLEAN)
        if n > 1:  # S changes only when a window ends, so a window's gradients share one S
            b.op("Where", [update, s_new, SCALE], out=SCALE + NEXT)
            b.op("Where", [update, c_new, CLEAN], out=CLEAN + NEXT)
        else:
            b.op("Identity", [s_new], out=SCALE + NEXT)
            b.op("Identity", [c_new], out=CLEAN + NEXT)
    return new, applied, micro_finite, kinds


def initial_state(values: dict, st: State, cfg: dict) -> dict:
    """{logical state tensor: initial value}: weights and BN statistics from the model
    (`values`), moments and accumulation sums zero, S its init_scale, counters 0."""
    shapes = {t: shape for table in st.flat["buffers"].values() for t, _, shape in table}
    init = {}
    for name, kind in st.pairs:
        if kind in ("weight", "bn"):
            init[name] = values[name].astype(np.float32)
        elif kind in ("moment", "accum"):
            init[name] = np.zeros(shapes[name], dtype=np.float32)
        elif name == SCALE:
            init[name] = np.array(cfg["init_scale"], np.float32)
        else:
            init[name] = np.array(0, np.int64)
    return init


def set_outputs(model, loss_t: str, st: State, expose_grads: bool) -> None:
    """Needs the update added (st.flat). Sets the step graph's outputs: loss, all_finite, every
    X__next of the graph's state (in its order), then with expose_grads each <weight>__grad
    (its slice of flat__grad / S, in its shape)."""
    buffers, align = st.flat["buffers"], st.flat["align"]
    elem_of = {STEP: TensorProto.INT64, CLEAN: TensorProto.INT64, ACCUM_COUNT: TensorProto.INT64}
    shape_of = {SCALE: []}
    shape_of.update({n: [fl.buffer_size(t, align)] for n, t in buffers.items()})
    outputs = [helper.make_tensor_value_info(loss_t, TensorProto.FLOAT, []),
               helper.make_tensor_value_info(FINITE, TensorProto.BOOL, [])]
    outputs += [helper.make_tensor_value_info(name + NEXT, elem_of.get(name, TensorProto.FLOAT),
                                              shape_of.get(name, [])) for name, _ in st.graph_pairs]
    if expose_grads:
        table = buffers[fl.WEIGHTS]
        grads = [w + GRAD for w, _, _ in table]
        b = Builder(model, prefix=PREFIX)
        unscaled = b.op("Mul", [fl.GRAD, b.op("Reciprocal", [st.scale])])
        model.graph.node.extend(fl.split_views(model.graph, unscaled, table, grads, PREFIX, align))
        outputs += [helper.make_tensor_value_info(g, TensorProto.FLOAT, shape)
                    for g, (_, _, shape) in zip(grads, table)]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
