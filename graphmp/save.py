"""Writing outputs without destroying anything.

- `save_model` writes a model atomically (temporary files, fsync, rename) and streams its
  weights tensor by tensor, converting the ones marked for conversion on the way, so
  peak memory stays near the largest tensor. With external data, the model and its data
  file are replaced as a pair (_save_pair): a kill at any instant leaves the old pair or
  the new one, each consistent. Only data files graphmp wrote for the output are ever
  removed: the one the old model's metadata records (DATA_FILE_KEY), and orphans of a
  killed run whose (st_dev, st_ino) it recorded first (_record_owned).
- `atomic_write` / `write_json` / `save_npz`: other outputs, atomically; an existing
  output that is not a regular file is refused (paths.check_target), or, for text the
  user named, written in place (a FIFO, a device, /dev/stdout).
- Temporary files are named after the output and the writing process
  (.graphmp-<output>-<pid>-*.tmp): an interrupted run removes its own; files left by a
  killed run (SIGKILL, power loss) are removed by the next write to the same output,
  unless they are a file this process reads.
"""
from __future__ import annotations

import contextlib
import os
import re
import tempfile

import numpy as np
import onnx
from onnx import TensorProto

from .errors import GraphmpError
from .model_io import (CONVERT_MARK, INLINE_LIMIT, TWO_GB, is_external, iter_graphs, materialize, np_dtype, tensor_array,
                 tensor_nbytes)
from .paths import check_target, data_files, is_input, process_stream
from .wire import read_by_reference, write_streaming


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


def _writer_pid(name: str, head: str) -> int | None:
    """The pid in a temporary file's name `<head><pid>-...` (see _tmp_prefix), or None."""
    pid = name[len(head):].split("-", 1)[0] if name.startswith(head) else ""
    return int(pid) if pid.isdigit() else None


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
        pid = _writer_pid(name, head)
        if name.endswith(".tmp") and pid not in (None, os.getpid()) and not _pid_alive(pid) \
                and not is_input(os.path.join(d, name)):  # a model's data file may be named so
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
               external: bool, progress=None, before_commit=None):
    """Write `model` to `out_path` atomically.

    convert_fn(array, elem_type, name) -> (elem_type, bytes) applies conversions deferred
    to this streaming write (external tensors marked by the apply pass).
    external: write weights to a data file next to the model (see _save_pair). Otherwise
    the model is written in one file, its top-level weights streamed one at a time
    (graphmp.wire). An existing output that is not a regular file is never replaced.
    before_commit(tmp_path): called with the finished temporary model (its data file, if
    any, already in place) before it replaces `out_path`; if it raises, nothing is
    replaced, the temporary files go, and the exception propagates (the load check,
    graphmp/load_check.py, refuses a model ONNX Runtime cannot open this way).
    """
    check_target(out_path, "output model")
    if not external:
        return _save_inline(model, out_path, src_dir, convert_fn, progress, before_commit)
    return _save_pair(model, os.path.abspath(out_path), src_dir, convert_fn, progress, before_commit)


def _stream_tensors(model, data_f, data_name: str, src_dir, convert_fn, progress) -> None:
    """Append every initializer's data (inline ones over INLINE_LIMIT too) to `data_f`,
    64-byte aligned, one tensor at a time, and point the tensors at `data_name`."""
    offset = 0
    tensors = [t for g in iter_graphs(model.graph) for t in g.initializer]
    for i, t in enumerate(tensors):
        if progress and i % 50 == 0:
            progress(i, len(tensors))
        if is_external(t):
            # source file -> data file, converted on the way where marked; the bytes
            # never enter the proto (protobuf keeps cleared bytes)
            raw = tensor_array(t, src_dir)
            if t.doc_string.startswith(CONVERT_MARK):
                elem, raw = convert_fn(raw, int(t.doc_string[len(CONVERT_MARK):]), t.name)
                t.data_type = elem
                t.ClearField("doc_string")
            else:
                raw = raw.tobytes()
        else:
            materialize(t, src_dir, convert_fn)
            if tensor_nbytes(t) <= INLINE_LIMIT or t.data_type == TensorProto.STRING:
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


def _owned_data_names(out_path: str) -> tuple[str, "re.Pattern"]:
    """The data file names that belong to the output `out_path`: OUT.data, or OUT.N.data
    while an older OUT.data is still referenced (a replaced pair never shares a name)."""
    base = os.path.basename(out_path)
    return base + ".data", re.compile(re.escape(base) + r"(\.\d+)?\.data")


def _link_fresh(tmp: str, out_path: str) -> str:
    """Give the finished data file `tmp` the first free name of OUT.data, OUT.1.data, ...
    (os.link never replaces a file: another writer or an input keeps its own). Returns it."""
    d = os.path.dirname(out_path)
    first, _ = _owned_data_names(out_path)
    for n in range(10000):
        name = first if n == 0 else f"{os.path.basename(out_path)}.{n}.data"
        try:
            os.link(tmp, os.path.join(d, name))
            return name
        except FileExistsError:
            continue
    raise GraphmpError(f"{out_path}: 10000 data files named after it exist already; remove the old ones")


DATA_FILE_KEY = "graphmp_data_file"  # metadata: the data file graphmp wrote for this model
_OWNED_SUFFIX = ".owned.tmp"  # a writer's record of the data file it is about to name OUT[.N].data


def _record_owned(record: str | None, out_path: str, files) -> str:
    """Write (or rewrite) a temporary record, named after the output and this process like
    every temporary file, of the (st_dev, st_ino) of data files this write owns: the new
    one before it gets its public name, and the old pair's before the commit. A run killed
    at any point leaves a record proving which OUT[.N].data files graphmp wrote, so the
    next write removes those that end up unreferenced, and nothing else. Returns its path."""
    import json
    idents = []
    for f in files:
        st = os.fstat(f) if isinstance(f, int) else os.lstat(f)
        idents.append([st.st_dev, st.st_ino])
    if record is None:
        fd, record = tempfile.mkstemp(prefix=_tmp_prefix(out_path), suffix=_OWNED_SUFFIX,
                                      dir=os.path.dirname(out_path))
    else:
        fd = os.open(record, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        json.dump({"owned": idents}, f)
        f.flush()
        os.fsync(f.fileno())
    return record


def _orphan_records(d: str, names, head: str) -> tuple[set, list]:
    """((st_dev, st_ino) of every data file that a killed writer of this output recorded
    (_record_owned), the record files' paths). Records of live processes are not read."""
    import json
    idents, paths = set(), []
    for name in names:
        pid = _writer_pid(name, head)
        if not name.endswith(_OWNED_SUFFIX) or pid in (None, os.getpid()) or _pid_alive(pid):
            continue
        path = os.path.join(d, name)
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read(1 << 16))
            idents.update((int(dev), int(ino)) for dev, ino in rec["owned"])
            paths.append(path)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return idents, paths


def _remove_orphans(out_path: str, keep) -> None:
    """Remove the data files named after OUT that a killed graphmp wrote and the model now
    at OUT does not reference: those whose (st_dev, st_ino) a dead writer recorded
    (_record_owned). Any other file, a user's OUT.3.data included, is never removed.
    Skipped while another live process writes OUT (its temp files exist)."""
    d = os.path.dirname(out_path)
    head = f".graphmp-{os.path.basename(out_path)}-"
    names = os.listdir(d)
    writers = {_writer_pid(n, head) for n in names} - {None, os.getpid()}
    if any(_pid_alive(pid) for pid in writers):
        return
    idents, records = _orphan_records(d, names, head)
    _, owned = _owned_data_names(out_path)
    live = set(_referenced_data(out_path))
    for name in names:
        path = os.path.join(d, name)
        if not owned.fullmatch(name) or os.path.realpath(path) in live | set(keep) or is_input(path):
            continue
        try:
            st = os.lstat(path)  # a symlink is never ours
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in idents:
            _unlink_quietly(path)
    for path in records:
        _unlink_quietly(path)


def _model_at(out_path: str):
    """The model now at `out_path` (its graph and metadata, no weights read), or None where
    there is none or it cannot be read: an unreadable old output references nothing we own."""
    if not os.path.isfile(out_path):
        return None
    try:
        return read_by_reference(out_path)
    except Exception:  # noqa: BLE001 - any parse failure: not a model graphmp can vouch for
        return None


def _referenced_data(out_path: str) -> list[str]:
    """The real paths of the data files the model now at `out_path` references."""
    old = _model_at(out_path)
    return [] if old is None else data_files(old, os.path.dirname(os.path.abspath(out_path)), inputs=False)


def _old_data(out_path: str, keep) -> list[str]:
    """The data file of the model now at `out_path` that graphmp wrote for it, to remove
    once the new pair has replaced it: the one its graphmp metadata records
    (DATA_FILE_KEY), named after OUT (OUT.data, OUT.N.data), a regular file, not in `keep`
    and no input. A model graphmp did not write keeps its data files."""
    old = _model_at(out_path)
    if old is None:
        return []
    recorded = {p.key: p.value for p in old.metadata_props}.get(DATA_FILE_KEY, "")
    _, owned = _owned_data_names(out_path)
    if not owned.fullmatch(recorded):
        return []
    path = os.path.join(os.path.dirname(out_path), recorded)  # referenced or not: all its tensors may be inline
    if not os.path.isfile(path) or os.path.islink(path) or os.path.realpath(path) in keep or is_input(path):
        return []
    return [os.path.realpath(path)]


def _set_data_file_record(model, data_name: str) -> None:
    """Record in the model's metadata the data file graphmp wrote for it (see _old_data)."""
    keep = [p for p in model.metadata_props if p.key != DATA_FILE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    entry = model.metadata_props.add()
    entry.key, entry.value = DATA_FILE_KEY, data_name


def _save_pair(model, out_path: str, src_dir, convert_fn, progress, before_commit=None):
    """The model and its data file, replaced as a pair: the new data is written under a
    name no file has (OUT.data, else OUT.1.data, ...), the .onnx is renamed over the old
    one last, and only then the old pair's own data file is removed. A kill at any
    instant leaves the old pair or the new pair, each consistent (at worst an orphan
    data file nothing references, which the next write removes: its identity was
    recorded first); a data file some input reads, or that graphmp did not write, is
    never written or removed."""
    d = os.path.dirname(out_path)
    keep = set(data_files(model, src_dir))
    _remove_orphans(out_path, keep)  # before the stale temp files go: their records name the orphans
    remove_stale_temp_files(out_path)
    tmp_files = []
    try:
        fd, data_tmp = tempfile.mkstemp(prefix=_tmp_prefix(out_path), suffix=".data.tmp", dir=d)
        tmp_files.append(data_tmp)
        _public(fd)
        with os.fdopen(fd, "wb") as data_f:
            _stream_tensors(model, data_f, "<data file>", src_dir, convert_fn, progress)
            data_f.flush()
            os.fsync(data_f.fileno())
            record = _record_owned(None, out_path, [data_f.fileno()])
            tmp_files.append(record)
        data_name = _link_fresh(data_tmp, out_path)
        tmp_files.insert(0, os.path.join(d, data_name))  # until the commit: an error removes it
        tmp_files.remove(data_tmp)
        os.unlink(data_tmp)  # one link only: onnx refuses data files with several
        for g in iter_graphs(model.graph):
            for t in g.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data_name
        _set_data_file_record(model, data_name)
        blob = model.SerializeToString()
        if len(blob) >= TWO_GB:
            raise GraphmpError(f"{out_path}: the graph alone is over 2 GB; ONNX cannot store it.")
        fd, model_tmp = tempfile.mkstemp(prefix=_tmp_prefix(out_path), suffix=".onnx.tmp", dir=d)
        tmp_files.append(model_tmp)
        _public(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit(model_tmp)
        old = _old_data(out_path, keep | {os.path.realpath(os.path.join(d, data_name))})
        if old:  # a kill after the commit leaves the old data file: the record proves it is ours
            _record_owned(record, out_path, [os.path.join(d, data_name)] + old)
        os.replace(model_tmp, out_path)  # the commit: the new pair is live
        tmp_files = [record]  # the record goes last: until the old data is gone
        _fsync_dir(d)
        for f in old:
            _unlink_quietly(f)
    except OSError as e:
        raise GraphmpError(f"{out_path}: could not write the output ({e.strerror or e}). "
                           "Check free disk space and permissions; nothing was written.") from None
    finally:
        for f in tmp_files:
            _unlink_quietly(f)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(d: str) -> None:
    """Make the renames in folder `d` durable (a power loss keeps the new pair)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _save_inline(model, out_path, src_dir, convert_fn, progress, before_commit=None):
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
        with atomic_write(out_path, before_commit=before_commit) as f:
            write_streaming(model, f, tensor_data)
    except OSError as e:
        raise GraphmpError(f"{out_path}: could not write the output ({e.strerror or e}). "
                           "Check free disk space and permissions; nothing was written.") from None


@contextlib.contextmanager
def _open_in_place(path: str, mode: str):
    """A FIFO or device opened as it is, or this process's own stream (/dev/stdout) written
    through its descriptor, after what Python has buffered for it, so output stays in order."""
    import sys
    fd = process_stream(path)
    if fd is None:
        with open(path, mode) as f:
            yield f
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with os.fdopen(os.dup(fd), mode) as f:
        yield f


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb", in_place_ok: bool = False, before_commit=None):
    """Open a temporary file next to `path`; on success fsync it and rename it over
    `path`, on error remove it. Readers never see a half-written file. An existing
    `path` that is not a regular file is refused, or with `in_place_ok` (text outputs
    the user named: `--report /dev/stdout`) a FIFO or character device is written in
    place, never replaced. before_commit(tmp_path), if given, runs on the finished file
    before the rename; if it raises, the file goes and `path` is untouched."""
    if check_target(path, "output", in_place_ok):
        with _open_in_place(path, mode) as f:
            yield f
        return
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
        if before_commit is not None:
            before_commit(tmp)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def write_json(path: str, data, in_place_ok: bool = False) -> None:
    """Write JSON atomically (a GraphmpError naming the path when it cannot be written);
    in_place_ok: see atomic_write."""
    import json
    try:
        with atomic_write(path, "w", in_place_ok) as f:
            json.dump(data, f, indent=2, default=str)
    except OSError as e:
        raise GraphmpError(f"{path}: could not write ({e.strerror or e}); nothing was written") from None


def save_npz(path: str, arrays: dict) -> None:
    """np.savez, atomically."""
    with atomic_write(path) as f:
        np.savez(f, **arrays)
