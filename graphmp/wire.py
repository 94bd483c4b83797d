"""The protobuf wire format of a model file, where weights must not be parsed or copied.

Parsing an .onnx file with protobuf holds the file's bytes and the parsed message at
once (2x the model), and a parsed weight cannot be handed to ONNX Runtime or numpy
without another copy. Two ways around it, both plain protobuf (the format is stable
and documented: https://protobuf.dev/programming-guides/encoding/):

- `read_by_reference(path)`: the model with every large top-level initializer turned
  into an external-data reference into the .onnx file itself (location = the file's
  own name, offset = where its raw bytes are). Everything downstream already handles
  external data (one tensor read at a time, ONNX Runtime reading the file itself), so
  a model costs its graph structure, not its weights. The file is memory-mapped and
  only the non-weight bytes are copied.
- `write_streaming(model, f, tensor_data)`: writes a model whose top-level
  initializers' data comes from `tensor_data(t)` one tensor at a time, so the full
  serialized model is never in memory.
"""
from __future__ import annotations

import mmap
import os

import onnx
from onnx import TensorProto

# ModelProto.graph, GraphProto.initializer, TensorProto.raw_data / data_location / data_type
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW, _TENSOR_LOCATION = 7, 5, 9, 14
_LEN = 2  # wire type of length-delimited fields
BY_REFERENCE_MIN = 4096  # smaller tensors stay inline (parsing them costs nothing)


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, field start, payload start, payload end) of each field in
    buf[start:end]; raises ValueError on malformed input."""
    pos = start
    while pos < end:
        fstart = pos
        tag, pos = _varint(buf, pos)
        field, wt = tag >> 3, tag & 7
        if wt == 0:  # the payload is the varint itself
            pstart = pos
            _, pos = _varint(buf, pos)
            yield field, wt, fstart, pstart, pos
            continue
        if wt == 1:
            pstart, pos = pos, pos + 8
        elif wt == 5:
            pstart, pos = pos, pos + 4
        elif wt == _LEN:
            n, pstart = _varint(buf, pos)
            pos = pstart + n
        else:
            raise ValueError(f"unsupported wire type {wt} at byte {fstart}")
        if pos > end:
            raise ValueError(f"field {field} at byte {fstart} runs past the end of its message")
        yield field, wt, fstart, pstart, pos


def _tensor_by_reference(buf, start: int, end: int, location: str):
    """The TensorProto at buf[start:end] without its raw_data, pointing at it in the file
    instead; None when it has no large raw_data (or is already external)."""
    raw = None
    for field, wt, fstart, pstart, pend in _fields(buf, start, end):
        if field == _TENSOR_LOCATION and wt == 0 and _varint(buf, pstart)[0] == TensorProto.EXTERNAL:
            return None  # already external data
        if field == _TENSOR_RAW and wt == _LEN:
            raw = (fstart, pstart, pend)
    if raw is None or raw[2] - raw[1] < BY_REFERENCE_MIN:
        return None
    t = TensorProto()
    t.ParseFromString(bytes(buf[start:raw[0]]) + bytes(buf[raw[2]:end]))
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(raw[1])), ("length", str(raw[2] - raw[1]))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def read_by_reference(path: str) -> onnx.ModelProto:
    """The model at `path` with its large top-level initializers as external-data
    references into the file itself (see the module doc). Raises ValueError (or
    protobuf's DecodeError) for a file that is not a well-formed message."""
    location = os.path.basename(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            model_parts, graphs = [], 0
            for field, wt, fstart, pstart, pend in _fields(buf, 0, size):
                if field != _MODEL_GRAPH or wt != _LEN:
                    model_parts.append(buf[fstart:pend])
                    continue
                graphs += 1
                graph_parts = []
                for gf, gwt, gfs, gps, gpe in _fields(buf, pstart, pend):
                    t = _tensor_by_reference(buf, gps, gpe, location) if (gf, gwt) == (_GRAPH_INITIALIZER, _LEN) else None
                    if t is None:
                        graph_parts.append(buf[gfs:gpe])
                    else:
                        body = t.SerializeToString()
                        graph_parts.append(_encode_varint(_GRAPH_INITIALIZER << 3 | _LEN) + _encode_varint(len(body)) + body)
                graph = b"".join(graph_parts)
                model_parts.append(_encode_varint(_MODEL_GRAPH << 3 | _LEN) + _encode_varint(len(graph)) + graph)
    model = onnx.ModelProto()
    model.ParseFromString(b"".join(model_parts))
    return model


def is_self_reference(t: TensorProto, path: str) -> bool:
    """Whether `t` is a by-reference weight of the model file at `path`."""
    if t.data_location != TensorProto.EXTERNAL:
        return False
    loc = next((e.value for e in t.external_data if e.key == "location"), None)
    return loc == os.path.basename(path)


def _field_header(field: int, length: int) -> bytes:
    return _encode_varint(field << 3 | _LEN) + _encode_varint(length)


def _repeated(desc) -> bool:
    rep = getattr(desc, "is_repeated", None)  # protobuf >= 5.28; `label` is gone in 7
    return rep if isinstance(rep, bool) else desc.label == desc.LABEL_REPEATED


def copy_except(src, dst, skip: str):
    """Copy every set field of message `src` but `skip` into `dst` (returned)."""
    for desc, value in src.ListFields():
        if desc.name == skip:
            continue
        if _repeated(desc):
            getattr(dst, desc.name).extend(value)
        elif desc.message_type is not None:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)
    return dst


def write_streaming(model: onnx.ModelProto, f, tensor_data) -> None:
    """Serialize `model` to the binary file `f`, taking the data of each top-level
    initializer from `tensor_data(t) -> (meta, nbytes, chunks)`: `meta` is the
    TensorProto to write without data (dims, type, name), `nbytes` the data length, and
    `chunks()` yields the bytes. Only one tensor's data is in memory at a time. The
    result parses to the same message as a plain SerializeToString of the final model."""
    g = model.graph
    rest = copy_except(g, onnx.GraphProto(), "initializer")
    head = copy_except(model, onnx.ModelProto(), "graph")
    plans = []
    for t in g.initializer:
        meta, nbytes, chunks = tensor_data(t)
        meta_bytes = meta.SerializeToString()
        body = len(meta_bytes) + (len(_field_header(_TENSOR_RAW, nbytes)) + nbytes if nbytes else 0)
        plans.append((meta_bytes, nbytes, chunks, body))
    rest_bytes = rest.SerializeToString()
    graph_len = len(rest_bytes) + sum(len(_field_header(_GRAPH_INITIALIZER, b)) + b for *_, b in plans)
    f.write(head.SerializeToString())
    f.write(_field_header(_MODEL_GRAPH, graph_len))
    f.write(rest_bytes)
    for meta_bytes, nbytes, chunks, body in plans:
        f.write(_field_header(_GRAPH_INITIALIZER, body))
        f.write(meta_bytes)
        if nbytes:
            f.write(_field_header(_TENSOR_RAW, nbytes))
            written = 0
            for c in chunks():
                f.write(c)
                written += len(c)
            if written != nbytes:
                raise RuntimeError(f"tensor data of {nbytes} bytes announced, {written} written")
