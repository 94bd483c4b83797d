"""Reading models (and data) without surprises; graphmp.save writes them.

- `load_model` never loads external data: weights are read one tensor at a time
  (`tensor_array`), so models over 2 GB cost their graph structure plus one tensor.
  Before any work it refuses what could hurt: a malformed graph (graphmp.sanity), and
  external data outside the model's folder or disagreeing with its file
  (graphmp.paths); small and attribute tensors in external data are read inline then.
  Each data file stays open from that check on, and every later read of a weight
  (`tensor_array`, `load_with_weights`, ONNX Runtime sessions) goes through its checked
  descriptor, never its path.
- `load_npz` reads .npz data with bounded memory (graphmp.npz).
- `open_model` also refuses an output that would overwrite the model or a file it reads.
"""
from __future__ import annotations

import os

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from .errors import GraphmpError
from .ir import attr_graphs, iter_graphs  # noqa: F401  (re-exported: most modules take them from here)
from .paths import (allow_self_reference, check_external, check_target, data_files, external_file, note_inputs,
                    refuse_clobber)
from .sanity import check_graph, check_schemas
from .wire import BY_REFERENCE_MIN, read_by_reference

TWO_GB = 2**31
INLINE_LIMIT = 1024  # tensors this small stay inline when writing external data


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def external_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def np_dtype(elem_type: int):
    if elem_type == TensorProto.BFLOAT16:
        return np.dtype(np.uint16)
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def tensor_nbytes(t: TensorProto) -> int:
    n = 1
    for d in t.dims:  # Python ints: a declared 4 TiB tensor must not wrap around
        n *= int(d)
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return n * np_dtype(t.data_type).itemsize


def tensor_array(t: TensorProto, base_dir: str) -> np.ndarray:
    """The tensor's values (bfloat16 comes back as raw uint16), reading external data
    from `base_dir` without attaching it to the proto."""
    if not is_external(t):
        if t.data_type == TensorProto.BFLOAT16:  # raw bytes, or int32_data (onnx.helper.make_tensor's form)
            bits = (np.frombuffer(t.raw_data, dtype=np.uint16) if t.raw_data
                    else np.asarray(t.int32_data, dtype=np.uint16))
            return bits.reshape(tuple(t.dims))
        return onnx.numpy_helper.to_array(t)
    dtype = np_dtype(t.data_type)
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    checked, offset, length = external_file(t, base_dir, tensor_nbytes(t))
    buf = checked.read(offset, length)  # through the descriptor checked at load, never the path again
    if len(buf) != count * dtype.itemsize:
        raise GraphmpError(f"{checked.loc}: external data for tensor '{t.name}' is truncated "
                           f"(wanted {count * dtype.itemsize} bytes at offset {offset}, got {len(buf)}). "
                           "Copy the complete .data file next to the model.")
    return np.frombuffer(buf, dtype=dtype).reshape(tuple(t.dims))


def load_model(path: str, by_reference: bool = False) -> onnx.ModelProto:
    """Load the graph (not the external weights) with clear errors for bad input.

    by_reference: large weights stored inside the .onnx file are not parsed either:
    they become external-data references into the file itself (graphmp.wire), read one
    tensor at a time like external data. Peak memory is then the graph, not the model."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise GraphmpError(f"{path}: no such file. Give the path of an .onnx model.")
    if os.path.isdir(path):
        raise GraphmpError(f"{path}: is a directory. Give the path of an .onnx model file.")
    try:
        if by_reference:
            allow_self_reference(path)
        model = read_by_reference(path) if by_reference else onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError, IndexError) as e:
        raise GraphmpError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:120]}). "
                           "Check that the file is a complete .onnx export (not truncated, not another format).") from None
    if not model.graph.node or not model.graph.output:
        raise GraphmpError(f"{path}: parsed, but holds no graph (no nodes or no outputs); the file is "
                           "probably truncated or not an ONNX model. Re-export it.")
    if not model.opset_import:
        raise GraphmpError(f"{path}: the model declares no opset_import; it is not a valid ONNX model.")
    check_graph(model, path)
    base = os.path.dirname(os.path.abspath(path))
    note_inputs([path])
    try:
        check_external(model, base, tensor_nbytes)
        _inline_small_external(model, base)
    except GraphmpError as e:
        raise GraphmpError(f"{path}: {e}") from None
    check_schemas(model, path)
    return model


def load_with_weights(path) -> onnx.ModelProto:
    """The model at `path` with every weight in memory (what onnx.load gives, for the
    reference evaluator and graph rewrites that need the values), read through the
    checked descriptors (graphmp.paths), never by a path the model names."""
    path = os.fspath(path)
    model = load_model(path, by_reference=True)
    base = os.path.dirname(os.path.abspath(path))
    for g in iter_graphs(model.graph):
        for t in g.initializer:
            materialize(t, base, None)
    return model


def _inline_small_external(model, base: str) -> None:
    """Read external tensors that are small (under wire.BY_REFERENCE_MIN bytes), held by a
    node attribute (Constant) or sparse, into the proto through the checked reader.
    Passes and onnx helpers then meet them as plain values: onnx's numpy_helper.to_array
    would otherwise read an external tensor relative to the working directory."""
    def inline(t):
        if is_external(t):
            arr = tensor_array(t, base)
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            t.raw_data = np.ascontiguousarray(arr).tobytes()

    for g in iter_graphs(model.graph):
        for t in g.initializer:
            if is_external(t) and tensor_nbytes(t) < BY_REFERENCE_MIN:
                inline(t)
        for s in g.sparse_initializer:
            inline(s.values)
            inline(s.indices)
        for n in g.node:
            for a in n.attribute:
                for t in ([a.t] if a.HasField("t") else []) + list(a.tensors):
                    inline(t)
                if a.HasField("sparse_tensor"):
                    inline(a.sparse_tensor.values)
                    inline(a.sparse_tensor.indices)


def skeleton(model):
    """A copy of the model whose external and large FP32 weights carry no data (dims and
    types kept): what shape inference needs, at the cost of the graph, not the weights."""
    skel = onnx.ModelProto()
    skel.CopyFrom(model)
    for g in iter_graphs(skel.graph):
        for t in g.initializer:
            if t.data_location == TensorProto.EXTERNAL or (t.data_type == TensorProto.FLOAT and len(t.raw_data) > 4096):
                t.ClearField("raw_data")
                t.ClearField("float_data")
                del t.external_data[:]
                t.data_location = TensorProto.DEFAULT
    return skel


def model_files(path) -> list[str]:
    """The model file and every data file its external tensors read (real paths), for
    refusing outputs that would overwrite them. [] when the model cannot be read (the
    command reports that itself)."""
    path = os.fspath(path)
    try:
        model = read_by_reference(path)
    except Exception:  # noqa: BLE001 - unreadable: load_model gives the one-line error later
        return [os.path.realpath(path)] if os.path.exists(path) else []
    return [os.path.realpath(path)] + data_files(model, os.path.dirname(os.path.abspath(path)))


def model_inputs(label: str, path) -> list:
    """(label, real path) of the model file `path` and of each external data file it reads
    (model_files): the inputs no output may be (paths.refuse_clobber)."""
    p = os.fspath(path)
    return [(label if i == 0 else f"a data file of {label}", f) for i, f in enumerate(model_files(p))]


def model_weight_bytes(model: onnx.ModelProto) -> int:
    return sum(tensor_nbytes(t) for g in iter_graphs(model.graph) for t in g.initializer)


def check_writable(out_path: str, src_path: str | None, what: str = "output", in_place_ok: bool = False):
    """Fail before any work when `out_path` cannot be written: its folder is missing or
    read-only, it is the input (same file, by samefile/realpath), or it exists and is not
    a regular file (see paths.check_target)."""
    out_abs = os.path.abspath(out_path)
    if src_path is not None:
        refuse_clobber([(what, out_path)], [("the input", src_path)])
    d = os.path.dirname(out_abs)
    if not os.path.isdir(d):
        raise GraphmpError(f"{out_path}: output folder {d} does not exist. Create it first.")
    if not os.access(d, os.W_OK):
        raise GraphmpError(f"{out_path}: cannot write to folder {d} (permission denied). Choose a writable output path.")
    check_target(out_path, what, in_place_ok)


CONVERT_MARK = "graphmp:convert-to:"
# A line of a node's doc_string in a converted model: why convert kept the node FP32
# (graphmp.convert writes it, graphmp.inspect reads it back; the exporter's doc text is kept).
REASON_MARK = "graphmp: FP32: "


def open_model(src, dst=None, by_reference: bool = False):
    """(model, path, base_dir) for a path (loaded without external data; see load_model
    for by_reference) or a ModelProto (copied; the caller's stays untouched). Checks
    first that `dst`, if given, can be written and is not the input or a file it reads."""
    if isinstance(src, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(src)
        path, base_dir = "<model>", None
        check_graph(model, path)  # a model built in memory gets the checks a file gets
        check_schemas(model, path)
    else:
        path = os.fspath(src)
        if dst is not None:
            check_writable(os.fspath(dst), path)
        model = load_model(path, by_reference)
        base_dir = os.path.dirname(os.path.abspath(path))
        if dst is not None:
            refuse_clobber([("the output", dst)], [("the model's data file", f) for f in data_files(model, base_dir)])
    if dst is not None:
        check_writable(os.fspath(dst), None)
    return model, path, base_dir


def materialize(t: TensorProto, src_dir: str | None, convert_fn) -> None:
    """Bring an external tensor inline, applying a deferred conversion (marked in
    doc_string by the apply pass) on the way."""
    mark = t.doc_string.startswith(CONVERT_MARK)
    if not mark and not is_external(t):
        return
    arr = tensor_array(t, src_dir)
    if mark:
        elem, raw = convert_fn(arr, int(t.doc_string[len(CONVERT_MARK):]), t.name)
        t.ClearField("doc_string")
        t.data_type = elem
    else:
        raw = arr.tobytes()
    for f in ("raw_data", "float_data", "double_data"):
        t.ClearField(f)
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT
    t.raw_data = bytes(raw)


def load_npz(path, what: str = ".npz", hint: str = "") -> dict:
    """All arrays of an .npz by name, or a GraphmpError naming the file; each member is
    checked against its header and graphmp.npz's size limits before it is read."""
    from .npz import read_npz
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphmpError(f"{path}: no such file (expected an {what})")
    return read_npz(path, what, hint)
