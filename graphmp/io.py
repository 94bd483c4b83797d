"""Reading and writing models without surprises.

- `load_model` never loads external data: weights are read one tensor at a time
  (`tensor_array`), so models over 2 GB cost their graph structure plus one tensor.
- `save_model` writes atomically (temporary files, fsync, rename) and streams
  external data tensor by tensor, converting the ones marked for conversion on the
  way, so peak memory stays near the largest tensor.
- Temporary files are named after the output and the writing process
  (.graphmp-<output>-<pid>-*.tmp): an interrupted run removes its own; files left by a
  killed run (SIGKILL, power loss) are removed by the next write to the same output.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from .errors import GraphmpError
from .wire import read_by_reference, write_streaming

TWO_GB = 2**31
INLINE_LIMIT = 1024  # tensors this small stay inline when writing external data


def attr_graphs(a) -> list:
    """The subgraphs an attribute holds (If branches, Loop/Scan bodies)."""
    return [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)


def iter_graphs(graph):
    """Every GraphProto in the model: the main graph and all subgraphs."""
    yield graph
    for n in graph.node:
        for a in n.attribute:
            for g in attr_graphs(a):
                yield from iter_graphs(g)


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL


def external_info(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def np_dtype(elem_type: int):
    if elem_type == TensorProto.BFLOAT16:
        return np.dtype(np.uint16)
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


def tensor_nbytes(t: TensorProto) -> int:
    n = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return n * np_dtype(t.data_type).itemsize


def tensor_array(t: TensorProto, base_dir: str) -> np.ndarray:
    """The tensor's values (bfloat16 comes back as raw uint16), reading external data
    from `base_dir` without attaching it to the proto."""
    if not is_external(t):
        if t.data_type == TensorProto.BFLOAT16 and t.raw_data:
            return np.frombuffer(t.raw_data, dtype=np.uint16).reshape(tuple(t.dims))
        return onnx.numpy_helper.to_array(t)
    info = external_info(t)
    path = os.path.join(base_dir, info["location"])
    offset = int(info.get("offset", 0))
    dtype = np_dtype(t.data_type)
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    with open(path, "rb") as f:
        f.seek(offset)
        buf = f.read(count * dtype.itemsize)
    if len(buf) != count * dtype.itemsize:
        raise GraphmpError(f"{path}: external data for tensor '{t.name}' is truncated "
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
        model = read_by_reference(path) if by_reference else onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError, IndexError) as e:
        raise GraphmpError(f"{path}: not a readable ONNX model ({type(e).__name__}: {str(e)[:120]}). "
                           "Check that the file is a complete .onnx export (not truncated, not another format).") from None
    if not model.graph.node or not model.graph.output:
        raise GraphmpError(f"{path}: parsed, but holds no graph (no nodes or no outputs); the file is "
                           "probably truncated or not an ONNX model. Re-export it.")
    if not model.opset_import:
        raise GraphmpError(f"{path}: the model declares no opset_import; it is not a valid ONNX model.")
    base = os.path.dirname(os.path.abspath(path))
    for g in iter_graphs(model.graph):
        for t in g.initializer:
            if is_external(t):
                info = external_info(t)
                loc = info.get("location", "")
                full = os.path.join(base, loc)
                if not loc or not os.path.isfile(full):
                    raise GraphmpError(f"{path}: tensor '{t.name}' is stored in external data file '{loc}', "
                                       f"which is missing (looked in {base}). Copy it next to the model.")
                end = int(info.get("offset", 0)) + int(info.get("length", tensor_nbytes(t)))
                if os.path.getsize(full) < end:
                    raise GraphmpError(f"{full}: external data is truncated: tensor '{t.name}' ends at byte "
                                       f"{end}, the file has {os.path.getsize(full)}. Copy the complete file.")
    return model


def model_weight_bytes(model: onnx.ModelProto) -> int:
    return sum(tensor_nbytes(t) for g in iter_graphs(model.graph) for t in g.initializer)


def check_writable(out_path: str, src_path: str | None):
    out_abs = os.path.abspath(out_path)
    if src_path is not None and os.path.abspath(src_path) == out_abs:
        raise GraphmpError(f"{out_path}: output path is the input path; graphmp never overwrites its input. "
                           "Choose another output name with -o.")
    d = os.path.dirname(out_abs)
    if not os.path.isdir(d):
        raise GraphmpError(f"{out_path}: output folder {d} does not exist. Create it first.")
    if not os.access(d, os.W_OK):
        raise GraphmpError(f"{out_path}: cannot write to folder {d} (permission denied). Choose a writable output path.")


CONVERT_MARK = "graphmp:convert-to:"


def open_model(src, dst=None, by_reference: bool = False):
    """(model, path, base_dir) for a path (loaded without external data; see load_model
    for by_reference) or a ModelProto (copied; the caller's stays untouched). Checks
    first that `dst`, if given, can be written and is not the input."""
    if isinstance(src, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(src)
        path, base_dir = "<model>", None
    else:
        path = os.fspath(src)
        if dst is not None:
            check_writable(os.fspath(dst), path)
        model = load_model(path, by_reference)
        base_dir = os.path.dirname(os.path.abspath(path))
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


def _tmp_prefix(out_path: str) -> str:
    return f".graphmp-{os.path.basename(out_path)}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_temp_files(out_path: str) -> list[str]:
    """Remove temporary files that a killed graphmp left while writing `out_path` (those
    of a process that is still running are left alone). Returns the removed names."""
    d = os.path.dirname(os.path.abspath(out_path))
    head = f".graphmp-{os.path.basename(out_path)}-"
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(head) and name.endswith(".tmp")):
            continue
        pid = name[len(head):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(d, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _public(fd: int):
    """mkstemp files are 0600; give outputs the mode a normal file would get."""
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)


def save_model(model: onnx.ModelProto, out_path: str, src_dir: str | None, convert_fn,
               external: bool, progress=None):
    """Write `model` to `out_path` atomically.

    convert_fn(array, elem_type, name) -> (elem_type, bytes) applies conversions deferred
    to this streaming write (external tensors marked by the apply pass).
    external: write weights to '<out name>.data' next to the model. Otherwise the model
    is written in one file, its top-level weights streamed one at a time (graphmp.wire).
    """
    if not external:
        return _save_inline(model, out_path, src_dir, convert_fn, progress)
    out_path = os.path.abspath(out_path)
    d = os.path.dirname(out_path)
    data_name = os.path.basename(out_path) + ".data"
    remove_stale_temp_files(out_path)
    tmp_files = []
    try:
        data_tmp = None
        if external:
            fd, data_tmp = tempfile.mkstemp(prefix=_tmp_prefix(out_path), suffix=".data.tmp", dir=d)
            tmp_files.append(data_tmp)
            _public(fd)
            data_f = os.fdopen(fd, "wb")
        offset = 0
        tensors = [t for g in iter_graphs(model.graph) for t in g.initializer]
        for i, t in enumerate(tensors):
            if progress and i % 50 == 0:
                progress(i, len(tensors))
            if external and is_external(t):
                # source file -> data file, one tensor at a time, converted on the way where
                # marked; the bytes never enter the proto (protobuf keeps cleared bytes)
                raw = tensor_array(t, src_dir)
                if t.doc_string.startswith(CONVERT_MARK):
                    elem, raw = convert_fn(raw, int(t.doc_string[len(CONVERT_MARK):]), t.name)
                    t.data_type = elem
                    t.ClearField("doc_string")
                else:
                    raw = raw.tobytes()
            else:
                materialize(t, src_dir, convert_fn)
                if not external or tensor_nbytes(t) <= INLINE_LIMIT or t.data_type == TensorProto.STRING:
                    continue
                raw = t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
            pad = (-offset) % 64
            if pad:
                data_f.write(b"\0" * pad)
                offset += pad
            data_f.write(raw)
            for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                t.ClearField(f)
            del t.external_data[:]
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                e = t.external_data.add()
                e.key, e.value = k, v
            offset += len(raw)
        if external:
            data_f.flush()
            os.fsync(data_f.fileno())
            data_f.close()
        blob = model.SerializeToString()
        if len(blob) >= TWO_GB:
            raise GraphmpError(f"{out_path}: the model is over 2 GB; write it with --external-data.")
        fd, model_tmp = tempfile.mkstemp(prefix=_tmp_prefix(out_path), suffix=".onnx.tmp", dir=d)
        tmp_files.append(model_tmp)
        _public(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if external:
            os.replace(data_tmp, os.path.join(d, data_name))
        os.replace(model_tmp, out_path)
        tmp_files.clear()
    except OSError as e:
        raise GraphmpError(f"{out_path}: could not write the output ({e.strerror or e}). "
                           "Check free disk space and permissions; nothing was written.") from None
    finally:
        for f in tmp_files:
            try:
                os.unlink(f)
            except OSError:
                pass


def _save_inline(model, out_path, src_dir, convert_fn, progress):
    """save_model without external data: subgraph weights brought inline, top-level
    weights read, converted and written one at a time; fails before writing anything
    when the result would pass protobuf's 2 GB limit."""
    for g in iter_graphs(model.graph):
        if g is not model.graph:
            for t in g.initializer:
                materialize(t, src_dir, convert_fn)
    tensors = list(model.graph.initializer)
    done = [0]

    def target_nbytes(t):
        if not t.doc_string.startswith(CONVERT_MARK):
            return tensor_nbytes(t)
        count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        return count * np_dtype(int(t.doc_string[len(CONVERT_MARK):])).itemsize

    def tensor_data(t):
        mark = t.doc_string.startswith(CONVERT_MARK)
        if not mark and not is_external(t):
            return t, 0, None
        meta = TensorProto()
        meta.CopyFrom(t)
        for f in ("raw_data", "float_data", "double_data", "int32_data", "int64_data", "uint64_data", "doc_string"):
            meta.ClearField(f)
        del meta.external_data[:]
        meta.data_location = TensorProto.DEFAULT
        if mark:
            meta.data_type = int(t.doc_string[len(CONVERT_MARK):])
        nbytes = tensor_nbytes(meta)

        def chunks():
            if progress and done[0] % 50 == 0:
                progress(done[0], len(tensors))
            done[0] += 1
            arr = tensor_array(t, src_dir)
            if mark:
                elem, raw = convert_fn(arr, meta.data_type, t.name)
                if elem != meta.data_type:
                    raise RuntimeError(f"{t.name}: converted to type {elem}, announced {meta.data_type}")
                yield raw
            else:
                yield memoryview(np.ascontiguousarray(arr)).cast("B")
        return meta, nbytes, chunks

    size = model.ByteSize() + sum(target_nbytes(t) for t in tensors if is_external(t))
    if size >= TWO_GB:
        raise GraphmpError(f"{out_path}: the model is over 2 GB; write it with --external-data.")
    try:
        with atomic_write(out_path) as f:
            write_streaming(model, f, tensor_data)
    except OSError as e:
        raise GraphmpError(f"{out_path}: could not write the output ({e.strerror or e}). "
                           "Check free disk space and permissions; nothing was written.") from None


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Open a temporary file next to `path`; on success fsync it and rename it over
    `path`, on error remove it. Readers never see a half-written file."""
    d = os.path.dirname(os.path.abspath(path))
    remove_stale_temp_files(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=d)
    except OSError as e:
        raise GraphmpError(f"{path}: cannot write here ({e.strerror or e}); choose a writable path") from None
    _public(fd)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: str, data) -> None:
    """Write JSON atomically (a GraphmpError naming the path when it cannot be written)."""
    import json
    try:
        with atomic_write(path, "w") as f:
            json.dump(data, f, indent=2, default=str)
    except OSError as e:
        raise GraphmpError(f"{path}: could not write ({e.strerror or e}); nothing was written") from None


def load_npz(path, what: str = ".npz", hint: str = "") -> dict:
    """All arrays of an .npz by name, or a GraphmpError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GraphmpError(f"{path}: no such file (expected an {what})")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise GraphmpError(f"{path}: not a readable {what} ({str(e)[:160]}).{hint}") from None
    if isinstance(z, np.ndarray):
        raise GraphmpError(f"{path}: is an .npy file (one unnamed array); graphmp needs an {what} with one "
                           f"array per name.{hint or ' Save one with numpy.savez(path, name=array).'}")
    with z:
        try:
            return {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise GraphmpError(f"{path}: not a readable {what} ({str(e)[:160]}).{hint}") from None


def save_npz(path: str, arrays: dict) -> None:
    """np.savez, atomically."""
    with atomic_write(path) as f:
        np.savez(f, **arrays)
