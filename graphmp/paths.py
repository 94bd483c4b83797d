"""Where graphmp may read and write: the rules for untrusted models and users' files.

Reading (a model's external data, the only place a model names a file):
- `external_file(t, base_dir)`: a tensor's data file, offset and length, only when the
  location is a relative path that stays inside the model's folder once every symlink
  is resolved, names a regular file with one hard link (as onnx asks), and the offset
  and length are non-negative integers within it; anything else is a GraphmpError
  naming the tensor and the location. The one exception: a model read by reference
  (graphmp.wire) may point its weights at its own file (`allow_self_reference`).
  `graphmp.model_io.tensor_array` reads through it, so every command does; the loader
  checks every external tensor (subgraphs and Constant attributes too) with it before any
  work starts.
- Each data file is opened once at that check (component by component from the model's
  folder, O_NOFOLLOW: see `CheckedFile`), and every later read of the model's weights
  (savers, calibration, ONNX Runtime sessions through `checked_descriptors`, emulation,
  training) goes through that descriptor, or through one reopened and proven to be the
  same file by (st_dev, st_ino): a data file swapped for a symlink after the check is
  never read.

Writing (outputs never replace an input, a device or a FIFO):
- `refuse_clobber(outputs, inputs)`: a one-line error before any work when an output
  path is one of the input files (the model, each data file it references, calibration
  or training data), or two outputs are one file, compared by `os.path.samefile` and
  realpath.
- `check_target(path, what, in_place_ok)`: an output that exists and is not a regular file
  (a device, FIFO, socket or directory, or a symlink to one), or that names a process's
  stream (/dev/stdout: with stdout redirected to a file a rename would replace the
  system's link), is refused; text outputs (`in_place_ok`) are written in place into a
  FIFO, character device or this process's stream instead, never replaced by a rename.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat

from onnx import TensorProto

from .errors import GraphmpError
from .ir import attr_graphs


def iter_tensors(graph):
    """Every TensorProto a graph holds, subgraphs included: initializers, sparse
    initializers' values and indices, and tensor-valued node attributes (Constant)."""
    yield from graph.initializer
    for s in graph.sparse_initializer:
        yield s.values
        yield s.indices
    for n in graph.node:
        for a in n.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("sparse_tensor"):
                yield a.sparse_tensor.values
                yield a.sparse_tensor.indices
            for g in attr_graphs(a):
                yield from iter_tensors(g)


def _entries(t: TensorProto) -> dict:
    return {e.key: e.value for e in t.external_data}


def _non_negative(t: TensorProto, key: str, value: str) -> int:
    v = value.strip()
    if not (v.isascii() and v.isdigit()):  # str.isdigit takes '²', which int() refuses
        raise GraphmpError(f"tensor '{t.name}': external data {key} '{value[:40]}' is not a non-negative "
                           "integer; the model is malformed (re-export it)")
    return int(v)


def resolve_inside(folder: str, name: str) -> tuple[str, bool]:
    """(real path of `name` under `folder`, whether it lies strictly inside the folder's real
    path once every symlink is resolved): the one containment test for a model's external
    data and a run folder's files."""
    base_real = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(base_real, name))
    return real, os.path.commonpath([base_real, real]) == base_real and real != base_real


def _inside(base_real: str, loc: str, t: TensorProto) -> str:
    """The real path of `loc` under the folder `base_real`, or an error when it leaves it."""
    why = None
    if not loc:
        why = "is empty"
    elif "\0" in loc:
        why = "holds a NUL byte"
    elif os.path.isabs(loc) or loc.startswith(("\\", "/")) or (len(loc) > 1 and loc[1] == ":"):
        why = "is an absolute path"
    elif ".." in loc.replace("\\", "/").split("/"):
        why = "climbs out with '..'"
    if why is None:
        real, inside = resolve_inside(base_real, loc)
        if inside:
            return real
        why = (f"resolves to {real}, outside the model's folder (a symlink leaves it; for a download cache "
               "that links files elsewhere, copy the model's folder with `cp -rL` first)")
    raise GraphmpError(f"tensor '{t.name}': external data location '{loc[:200]}' {why}; graphmp reads weights only "
                       f"from files inside the model's folder ({base_real}). Put the data file next to the model "
                       "and give its plain name")


class CheckedFile:
    """An external-data file opened once and checked through its descriptor: every later
    read of it goes through `fd` (or a descriptor reopened and proven to be the same
    file, by (st_dev, st_ino)), never through its path again, so a file swapped for a
    symlink after the check is never read."""

    def __init__(self, fd: int, st, loc: str):
        self.fd, self.loc = fd, loc
        self.ident = (st.st_dev, st.st_ino)
        self.size = st.st_size

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (fewer when the file was cut short since)."""
        parts, done = [], 0
        while done < length:
            b = os.pread(self.fd, min(length - done, 1 << 30), offset + done)
            if not b:
                break
            parts.append(b)
            done += len(b)
        return b"".join(parts)


_OPEN: dict = {}  # (folder's real path, location) -> CheckedFile, most recently used last
_IDENT: dict = {}  # the same keys -> (st_dev, st_ino) checked at load: a reopened file must match
_SELF: dict = {}  # (folder, name) -> the path of a model file read by reference (its own weights)
MAX_OPEN = 64  # a model may keep each tensor in its own file: beyond this, descriptors are reopened


def allow_self_reference(model_path: str) -> None:
    """A model read by reference (graphmp.wire) points its weights at its own file: allow
    that location even where the file is a symlink out of its folder (a download cache
    links model files to hashed blobs). Only the file the user named is allowed so."""
    base_real = os.path.realpath(os.path.dirname(os.path.abspath(model_path)))
    key = (base_real, os.path.basename(model_path))
    _SELF[key] = os.path.abspath(model_path)
    forget(key)


def forget(key) -> None:
    """Drop what was checked for (folder, location): the next read checks it afresh (a new
    load of a model checks its files again)."""
    _IDENT.pop(key, None)
    f = _OPEN.pop(key, None)
    if f is not None:
        os.close(f.fd)


def _open_no_symlinks(base_real: str, rel: str) -> int:
    """A read-only descriptor of `rel` under the folder `base_real`, opened component by
    component relative to the folder's descriptor with O_NOFOLLOW: a symlink put anywhere
    on the way after the containment check fails the open (ELOOP/ENOTDIR) instead of
    being followed. Non-blocking, so a FIFO cannot hang us."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    dir_fd = os.open(base_real, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        parts = rel.split(os.sep)
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = nxt
        return os.open(parts[-1], os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _open_checked(key, t: TensorProto) -> CheckedFile:
    """Open the data file of (folder, location) once and check the open descriptor: a
    regular file with one hard link (the model's own file read by reference excepted),
    the same file (st_dev, st_ino) as checked at load when it was checked before."""
    base_real, loc = key
    own_file = key in _SELF
    try:
        if own_file:
            fd = os.open(_SELF[key], os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # the file the user named
        else:
            real = _inside(base_real, loc, t)
            note_inputs([real])
            fd = _open_no_symlinks(base_real, os.path.relpath(real, base_real))
    except OSError as e:
        why = e.strerror
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            why += "; a symlink took the place of a checked path, and graphmp follows none there"
        raise GraphmpError(f"tensor '{t.name}': external data file '{loc}' cannot be read ({why}); copy the model's "
                           "data file next to it") from None
    st = os.fstat(fd)
    try:
        _check_opened(st, key, t, own_file)
    except GraphmpError:
        os.close(fd)
        raise
    if len(_OPEN) >= MAX_OPEN:
        forget_fd = _OPEN.pop(next(iter(_OPEN)))
        os.close(forget_fd.fd)
    f = _OPEN[key] = CheckedFile(fd, st, loc)
    _IDENT.setdefault(key, f.ident)
    return f


def _check_opened(st, key, t: TensorProto, own_file: bool) -> None:
    """Refuse an opened data file that is not a regular file, has several hard links (a
    hard link can bring a file from outside the folder in; onnx refuses them too) or is
    not the file checked before."""
    loc = key[1]
    if not stat.S_ISREG(st.st_mode):
        raise GraphmpError(f"tensor '{t.name}': external data location '{loc}' is not a regular file "
                           f"({_kind(st.st_mode)}); the weights must be in a plain file next to the model")
    if st.st_nlink > 1 and not own_file:
        raise GraphmpError(f"tensor '{t.name}': external data file '{loc}' has {st.st_nlink} hard links; graphmp, "
                           "like onnx, reads only data files with one (a hard link can bring in a file from outside "
                           "the model's folder). Copy the file to give it its own: cp FILE FILE.tmp && mv FILE.tmp FILE")
    if key in _IDENT and _IDENT[key] != (st.st_dev, st.st_ino):
        raise GraphmpError(f"tensor '{t.name}': external data file '{loc}' was replaced by another file after "
                           "graphmp checked it; graphmp reads only the file it checked. Leave the model's folder "
                           "unchanged while graphmp runs, then run the command again")


def checked_file(t: TensorProto, base_dir: str) -> CheckedFile:
    """The checked, open data file of an external tensor (see CheckedFile)."""
    if base_dir is None:
        raise GraphmpError(f"tensor '{t.name}' is stored in external data, but the model was given in memory "
                           "without its folder; load it from its file instead")
    key = (os.path.realpath(base_dir), _entries(t).get("location", ""))
    f = _OPEN.get(key)
    if f is not None:
        _OPEN[key] = _OPEN.pop(key)  # most recently used last
        return f
    return _open_checked(key, t)


def external_file(t: TensorProto, base_dir: str, nbytes: int | None = None) -> tuple[CheckedFile, int, int]:
    """(checked open data file, offset, length) of an external tensor's data (see the
    module doc). nbytes: the size the tensor's dims and type call for (checked against
    length). The size is taken from the open descriptor every time: the file may have
    changed since."""
    f = checked_file(t, base_dir)
    info = _entries(t)
    loc = info.get("location", "")
    size = os.fstat(f.fd).st_size
    offset = _non_negative(t, "offset", info["offset"]) if "offset" in info else 0
    length = _non_negative(t, "length", info["length"]) if "length" in info else (
        nbytes if nbytes is not None else max(size - offset, 0))
    if nbytes is not None and length != nbytes:
        raise GraphmpError(f"tensor '{t.name}': external data length {length} disagrees with its dims "
                           f"{list(t.dims)} ({nbytes} bytes); the model is malformed (re-export it)")
    if offset + length > size:
        raise GraphmpError(f"tensor '{t.name}': external data file '{loc}' is truncated: the tensor needs bytes "
                           f"{offset}..{offset + length}, the file has {size}. Copy the complete data file next to "
                           "the model")
    return f, offset, length


@contextlib.contextmanager
def checked_descriptors(model, base_dir: str | None):
    """Yields {location: descriptor of its checked data file} for every external-data file
    the model names (see CheckedFile): duplicates, closed when the block ends, so that no
    descriptor is closed under the caller while more files than MAX_OPEN are opened.
    A model with more data files than this process may open raises its soft limit."""
    tensors = {}
    for t in iter_tensors(model.graph):
        if t.data_location == TensorProto.EXTERNAL:
            tensors.setdefault(_entries(t).get("location", ""), t)
    if len(tensors) > 256:
        _allow_open_files(len(tensors) + MAX_OPEN + 256)
    fds = {}
    try:
        for loc, t in tensors.items():
            fds[loc] = os.dup(checked_file(t, base_dir).fd)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _allow_open_files(n: int) -> None:
    """Raise this process's soft limit on open files to n where the hard limit allows."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < n:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))
    except (ImportError, ValueError, OSError):
        pass  # then opening fails with a one-line error naming the file


def map_descriptors(fds: dict) -> tuple[list, list]:
    """(locations, read-only maps of the descriptors' files) for ONNX Runtime's
    add_external_initializers_from_files_in_memory. The maps cost address space, not
    memory; close them once the session is created."""
    import mmap
    names, maps = [], []
    try:
        for loc, fd in fds.items():
            size = os.fstat(fd).st_size
            names.append(loc)
            maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b"")
    except BaseException:
        for m in maps:
            if not isinstance(m, bytes):
                m.close()
        raise
    return names, maps


def external_locations(model) -> list:
    """The distinct external-data locations the model's tensors name, in first-use order."""
    out = []
    for t in iter_tensors(model.graph):
        if t.data_location == TensorProto.EXTERNAL:
            loc = _entries(t).get("location", "")
            if loc not in out:
                out.append(loc)
    return out


def check_external(model, base_dir: str, tensor_nbytes) -> None:
    """Check every external tensor of the model (see external_file) before any work. Each
    data file is checked afresh (a new load may see a new file) and stays open: every
    later read of the model's weights reads what was checked here."""
    base_real = os.path.realpath(base_dir)
    for loc in external_locations(model):
        if (base_real, loc) not in _SELF:
            forget((base_real, loc))
    for t in iter_tensors(model.graph):
        if t.data_location == TensorProto.EXTERNAL:
            if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
                raise GraphmpError(f"tensor '{t.name}': a {'string' if t.data_type else 'typeless'} tensor cannot be "
                                   "stored in external data (ONNX keeps those inline); the model is malformed")
            external_file(t, base_dir, tensor_nbytes(t))


def data_files(model, base_dir: str | None, inputs: bool = True) -> list[str]:
    """The real paths of the files the model's external tensors name (unchecked: for
    refusing outputs that would overwrite them; a bad location is skipped here and
    refused by external_file). inputs: remember them as this process's inputs (never
    deleted); False for a model graphmp is about to replace, not read."""
    if base_dir is None:
        return []
    base_real = os.path.realpath(base_dir)
    out = []
    for t in iter_tensors(model.graph):
        if t.data_location == TensorProto.EXTERNAL:
            loc = _entries(t).get("location", "")
            if not loc or "\0" in loc:
                continue
            real = os.path.realpath(os.path.join(base_real, loc))
            if real not in out:
                out.append(real)
    if inputs:
        note_inputs(out)
    return out


_INPUTS: set = set()  # real paths of every input this process has named: never deleted


def note_inputs(paths) -> None:
    """Remember files this process reads, so that no clean-up ever deletes one (a data
    file may be named like graphmp's own temporary files)."""
    _INPUTS.update(os.path.realpath(p) for p in paths)


def is_input(path: str) -> bool:
    return os.path.realpath(path) in _INPUTS


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


_STD = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}


def process_stream(path) -> int | None:
    """The descriptor N when `path` names one of this process's own open files: /dev/stdout
    (1), /dev/stderr (2), /dev/fd/N, /proc/self/fd/N, or a symlink to one; -1 for another
    path under /proc; None for any other path. With stdout redirected to a file,
    /dev/stdout resolves to a regular file, and an atomic write's rename would replace the
    system's /dev/stdout link itself: such a path is written through its descriptor."""
    p = os.path.abspath(os.fspath(path))
    selves = ("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/")
    for _ in range(40):  # link by link: realpath would resolve /proc's magic links to the file
        if p in _STD:
            return _STD[p]
        for head in selves:
            if p.startswith(head):
                n = p[len(head):]
                return int(n) if n.isdigit() else -1
        if p.startswith("/proc/"):
            return -1
        if not os.path.islink(p):
            return None
        try:
            p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
        except OSError:
            return None
    return None


def check_target(path: str, what: str = "output", in_place_ok: bool = False) -> bool:
    """Refuse an output that exists and is not a regular file (following symlinks), or
    that names a process's descriptor (/dev/stdout, /proc/...). Returns True when it must
    be written in place (a FIFO, character device or this process's own stream, allowed
    for text outputs: `--report /dev/stdout`), False for a normal atomic replace."""
    fd = process_stream(path)
    if fd is not None:
        if in_place_ok and fd >= 0:
            return True
        raise GraphmpError(f"{path}: {what} names a process's own stream (/dev/stdout, /dev/fd/N) or a file under "
                           f"/proc, which graphmp would replace; give {what} a file path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False  # new file, or a dangling symlink: the rename replaces the link itself
    except OSError as e:
        raise GraphmpError(f"{path}: cannot use as {what} ({e.strerror})") from None
    if stat.S_ISREG(st.st_mode):
        return False
    if in_place_ok and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        return True
    hint = " Give a file path (e.g. out/model.onnx)." if stat.S_ISDIR(st.st_mode) else ""
    raise GraphmpError(f"{path}: {what} is {_kind(st.st_mode)}; graphmp writes {what}s only to regular files "
                       f"and never replaces anything else.{hint}")


def _same(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def refuse_clobber(outputs, inputs) -> None:
    """outputs, inputs: (label, path) pairs (None paths are skipped). A one-line error when
    an output is an input, or two outputs are one file, before any work."""
    outputs = [(w, os.fspath(p)) for w, p in outputs if p is not None]
    inputs = [(w, os.fspath(p)) for w, p in inputs if p is not None]
    note_inputs(p for _, p in inputs)
    for i, (what, out) in enumerate(outputs):
        for src_what, src in inputs:
            if _same(out, src):
                raise GraphmpError(f"{out}: {what} is the same file as {src_what} ({src}); graphmp never "
                                   f"overwrites its inputs. Choose another path for {what}")
        for other_what, other in outputs[i + 1:]:
            if _same(out, other):
                raise GraphmpError(f"{out}: {what} and {other_what} name the same file; give each its own path")
