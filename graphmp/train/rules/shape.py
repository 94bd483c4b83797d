"""Gradient rules of data movement: reshapes, transposes, slicing, gathering, padding."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ...errors import GraphmpError
from ..emitter import attr, rule
from .common import _acc_type, _flat_scatter, _inputs, _row_scatter_add


# --- data movement -------------------------------------------------------------------------------

@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(em, node, g):
    """Y = X with another shape: dX = dY reshaped to X's shape."""
    return [em.reshape_like(g[0], node.input[0])]


@rule("Expand")
def expand(em, node, g):
    """Y = broadcast X to a shape: dX = dY summed over the broadcast axes."""
    return [em.unbroadcast(g[0], node.input[0], node.output[0]), None]


@rule("Transpose")
def transpose(em, node, g):
    """Y = transpose(X, perm): dX = transpose(dY, inverse perm)."""
    perm = attr(node, "perm")
    if perm is None:
        perm = list(range(em.rank(node.input[0])))[::-1]
    return [em.transpose(g[0], list(np.argsort(perm)))]


@rule("Concat")
def concat(em, node, g):
    """Y = concat(Xi, axis): dXi = the part of dY that Xi occupies (Split)."""
    axis = attr(node, "axis")
    sizes = em.op("Concat", [em.dim(x, axis) for x in node.input], axis=0)
    parts = em.op("Split", [g[0], sizes], outputs=len(node.input), axis=axis)
    parts = parts if isinstance(parts, list) else [parts]
    return [p if em.needs(x) else None for p, x in zip(parts, node.input)]


@rule("Split", outputs=None)
def split(em, node, g):
    """Yi = parts of X along axis: dX = concat(dYi) with zeros for parts without gradient."""
    parts = []
    for y, gy in zip(node.output, g):
        parts.append(gy if gy is not None else em.op(
            "ConstantOfShape", [em.shape(y)], value=helper.make_tensor("zero", em.dtype(y), [1], [0])))
    return [em.op("Concat", parts, axis=attr(node, "axis", 0)) if len(parts) > 1 else parts[0]]


@rule("Slice")
def slice_(em, node, g):
    """Y = X[starts:ends:steps]: dX = zeros with dY placed at the positions the slice selects
    (the same Slice applied to an iota of X gives those positions)."""
    x = node.input[0]
    iota = em.op("Reshape", [em.op("Range", [em.const(0, TensorProto.INT64), em.op("Size", [x]),
                                             em.const(1, TensorProto.INT64)]), em.shape_tensor(x)])
    picked = em.op("Slice", [iota] + list(node.input[1:]))
    return [_flat_scatter(em, x, picked, g[0], None)]


@rule("Gather", opset=16)
def gather(em, node, g):
    """Y = take(X, idx, axis): dX = zeros with the dY rows added at idx along axis (repeated
    indices accumulate; exact and run-to-run identical on ORT CPU: see _row_scatter_add)."""
    x, ind = node.input
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (Gather): its gradient needs ScatterElements with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    axis = attr(node, "axis", 0) % em.rank(x)
    return [_row_scatter_add(em, x, _positive_indices(em, ind, x, axis), g[0], axis, axis + 1), None]


@rule("Pad", opset=16)
def pad(em, node, g):
    """Y = X padded (pads may be negative: cropping). constant: dX = Pad(dY, -pads) (crops the
    padding, zero-fills what was cropped), dvalue = sum(dY) - sum(dX). reflect / edge / wrap:
    the same Pad applied to an iota of X's flat positions says which X element every Y element
    copies; dX = dY scatter-added there (ScatterElements add, opset >= 16)."""
    x, pads, value, axes = _inputs(node, 4)
    mode = attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    tail = ["", axes] if axes else []
    out = [None, None, None, None]
    if mode == "constant":
        gx = em.op("Pad", [g[0], em.op("Neg", [pads])] + tail, mode="constant")
        out[0] = gx if em.needs(x) else None
        if value and em.needs(value):
            out[2] = em.reshape_like(em.op("Sub", [em.op("ReduceSum", [g[0]], keepdims=0),
                                                   em.op("ReduceSum", [gx], keepdims=0)]), value)
        return out
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (Pad mode={mode}): its gradient needs ScatterElements with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    iota = em.op("Reshape", [em.op("Range", [em.const(0, TensorProto.INT64), em.op("Size", [x]),
                                             em.const(1, TensorProto.INT64)]), em.shape_tensor(x)])
    picked = em.op("Pad", [iota, pads] + tail, mode=mode)
    out[0] = _flat_scatter(em, x, picked, g[0], "add")
    return out


@rule("Tile")
def tile(em, node, g):
    """Y = X repeated r_i times along axis i: dY reshaped to [r0, d0, r1, d1, ...] (Y's axis i
    is r_i blocks of X's axis i) and summed over the r axes."""
    x, reps = node.input
    rank = em.rank(x)
    reps64 = em.cast(reps, TensorProto.INT64, em.dtype(reps))
    pairs = em.op("Concat", [em.unsqueeze(reps64, [1]), em.unsqueeze(em.shape_tensor(x), [1])], axis=1)
    blocks = em.op("Reshape", [g[0], em.op("Reshape", [pairs, em.ints([-1])])])
    return [em.reduce("ReduceSum", blocks, range(0, 2 * rank, 2), keepdims=0), None]


@rule("DepthToSpace")
def depth_to_space(em, node, g):
    """Y = DepthToSpace(X, b): DCR is undone by SpaceToDepth(dY, b); CRD by the inverse
    reshape/transpose: dY [N, C', H*b, W*b] -> [N, C', H, b, W, b] -> [N, C', b, b, H, W] -> X."""
    x = node.input[0]
    b = attr(node, "blocksize")
    mode = attr(node, "mode", b"DCR")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode == "DCR":
        return [em.op("SpaceToDepth", [g[0]], blocksize=b)]
    split = em.op("Concat", [em.ints([0, 0]), em.dim(x, 2), em.ints([b]), em.dim(x, 3), em.ints([b])], axis=0)
    return [em.reshape_like(em.transpose(em.op("Reshape", [g[0], split]), [0, 1, 3, 5, 2, 4]), x)]


@rule("SpaceToDepth")
def space_to_depth(em, node, g):
    """Y = SpaceToDepth(X, b), the inverse of DepthToSpace DCR: dX = DepthToSpace(dY, b, DCR)."""
    return [em.op("DepthToSpace", [g[0]], blocksize=attr(node, "blocksize"), mode="DCR")]


@rule("Trilu")
def trilu(em, node, g):
    """Y = the upper/lower triangle of X (diagonal offset k): dX = the same triangle of dY."""
    return [em.op("Trilu", [g[0]] + list(node.input[1:]), upper=attr(node, "upper", 1)), None]


def _positive_indices(em, idx: str, data: str, axis: int) -> str:
    """int64 indices with negative entries (counted from the end of data's axis) made positive."""
    idx = em.cast(idx, TensorProto.INT64, em.dtype(idx))
    size = em.op("Reshape", [em.dim(data, axis), em.ints([])])
    return em.op("Where", [em.op("Less", [idx, em.const(0, TensorProto.INT64)]), em.op("Add", [idx, size]), idx])


@rule("GatherElements", opset=16)
def gather_elements(em, node, g):
    """Y[i..] = X[.., idx[i..], ..] along axis: dX = zeros with dY added at the indices
    (ScatterElements, reduction add: repeated indices accumulate; FP32 accumulation)."""
    x, ind = node.input
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (GatherElements): its gradient needs ScatterElements with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    axis = attr(node, "axis", 0) % em.rank(x)
    dt = em.dtype(x)
    acc = _acc_type(dt)
    zeros = em.op("ConstantOfShape", [em.shape(x)], value=helper.make_tensor("zero", acc, [1], [0]))
    scat = em.op("ScatterElements", [zeros, _positive_indices(em, ind, x, axis), em.cast(g[0], acc, dt)],
                 axis=axis, reduction="add")
    return [em.cast(scat, dt, acc), None]


@rule("ScatterElements", "ScatterND")
def scatter(em, node, g):
    """Y = X with updates written at the indices (reduction none): dX = dY with the written
    positions zeroed (the same scatter of zeros), dupdates = dY gathered at the indices
    (GatherElements / GatherND). Indices are assumed unique, as the op requires.
    reduction add (torch's scatter_add / index_put accumulate; repeated indices allowed):
    Y = X + the updates summed at their indices, so dX = dY and dupdates = dY gathered."""
    x, ind, upd = node.input
    red = attr(node, "reduction", b"none")
    red = red.decode() if isinstance(red, bytes) else red
    if red not in ("none", "add"):
        raise GraphmpError(f"node '{node.name}' ({node.op_type}): reduction={red} is not differentiated (reduction "
                           "none and add are); export the scatter as a plain write or an add (torch: scatter / "
                           "scatter_add instead of scatter_reduce)")
    elements = node.op_type == "ScatterElements"
    kw = {"axis": attr(node, "axis", 0)} if elements else {}
    out = [None, None, None]
    if em.needs(x) and red == "add":
        out[0] = g[0]
    elif em.needs(x):
        zeros = em.op("ConstantOfShape", [em.shape(upd)], value=helper.make_tensor("zero", em.dtype(x), [1], [0]))
        out[0] = em.op(node.op_type, [g[0], ind, zeros], **kw)
    if em.needs(upd):
        out[2] = em.op("GatherElements" if elements else "GatherND", [g[0], ind], **kw)
    return out


@rule("TopK", outputs=(0,))
def topk(em, node, g):
    """Values = the k largest/smallest of X along axis, Indices where they were: dX = zeros
    with dValues written at Indices (ScatterElements; the indices of one row are distinct)."""
    x = node.input[0]
    zeros = em.op("ConstantOfShape", [em.shape(x)], value=helper.make_tensor("zero", em.dtype(x), [1], [0]))
    return [em.op("ScatterElements", [zeros, node.output[1], g[0]], axis=attr(node, "axis", -1)), None]


@rule("GatherND", opset=16)
def gather_nd(em, node, g):
    """Y = X gathered at index tuples (batch_dims=0): dX = zeros with dY added at the tuples
    (repeated tuples accumulate; FP32 accumulation). A tuple (i0..ik-1) into X's first k axes
    is the row i0*d1*..*dk-1 + .. + ik-1 of X seen as [d0*..*dk-1, rest], so the scatter is
    _row_scatter_add's (exact and run-to-run identical on ORT CPU)."""
    x, ind = node.input
    if attr(node, "batch_dims", 0):
        raise GraphmpError(f"node '{node.name}' (GatherND): batch_dims > 0 is not differentiated")
    if em.opset < 16:
        raise GraphmpError(f"node '{node.name}' (GatherND): its gradient needs ScatterElements with "
                           f"reduction='add' (opset >= 16); the model has opset {em.opset}")
    idims = em.dims(ind)
    if not idims or not isinstance(idims[-1], int):
        raise GraphmpError(f"node '{node.name}' (GatherND): the last axis of the indices '{ind}' must be static")
    k = idims[-1]
    idx = em.cast(ind, TensorProto.INT64, em.dtype(ind))
    head = em.op("Slice", [em.shape_tensor(x), em.ints([0]), em.ints([k])])
    idx = em.op("Where", [em.op("Less", [idx, em.const(0, TensorProto.INT64)]), em.op("Add", [idx, head]), idx])
    parts = [em.op("Gather", [idx, em.const(j, TensorProto.INT64)], axis=-1) for j in range(k)]
    rows = parts[0]
    for axis in range(1, k):  # Horner: ((i0 * d1 + i1) * d2 + i2) ...
        rows = em.op("Add", [em.op("Mul", [rows, em.dim(x, axis)]), parts[axis]])
    return [_row_scatter_add(em, x, rows, g[0], 0, k), None]
