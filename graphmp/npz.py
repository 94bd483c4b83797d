"""Reading .npz data files (calibration, check data, training and evaluation data, run
states) with bounded memory: every member is checked against its own header and the
limits below before a byte of it is inflated, so a zip bomb or a header that lies about
its size is a one-line error, never an allocation.

Checks, from the zip's central directory and each member's .npy header (a few hundred
bytes), before any array is read:
- every member is an .npy array (the magic string, a header numpy can parse, a dtype
  without Python objects: nothing is ever unpickled);
- the member's uncompressed size (the zip's file_size) is exactly its header plus
  shape x itemsize: a header claiming 58 TiB in a 1 KB member is refused, and the zip
  reader never inflates more than file_size bytes (it checks the CRC at the end);
- the total uncompressed size of all members is at most MAX_BYTES (default 8 GiB;
  environment variable GRAPHMP_MAX_NPZ_BYTES overrides it, in bytes);
- a member over RATIO_FROM bytes (64 MiB) inflates at most MAX_RATIO times (default
  200; GRAPHMP_MAX_NPZ_RATIO overrides it) its compressed size: a 17 MB member that
  inflates to 4 GiB is a zip bomb, not data (numpy.savez does not compress at all, and
  savez_compressed of real data stays far below that ratio).
"""
from __future__ import annotations

import os
import zipfile

import numpy as np

from .errors import GraphmpError

DEFAULT_MAX_BYTES = 8 << 30
DEFAULT_MAX_RATIO = 200
RATIO_FROM = 64 << 20
MAX_BYTES_ENV, MAX_RATIO_ENV = "GRAPHMP_MAX_NPZ_BYTES", "GRAPHMP_MAX_NPZ_RATIO"


def _limit(env: str, default: int) -> int:
    value = os.environ.get(env, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise GraphmpError(f"{env}={value[:40]}: must be a positive whole number")
    return int(value)


def _member_header(z: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, what: str):
    """(shape, fortran_order, dtype, header bytes) of one member, from its .npy header only."""
    name = info.filename
    with z.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except (ValueError, EOFError, OSError, zipfile.BadZipFile) as e:
            raise GraphmpError(f"{path}: member '{name[:80]}' is not an .npy array ({str(e)[:100]}); an {what} "
                               "holds one .npy array per name (numpy.savez)") from None
        header = f.tell()
    if dtype.hasobject:
        raise GraphmpError(f"{path}: array '{name[:80]}' holds Python objects; graphmp never unpickles data. "
                           "Save plain numeric arrays")
    return shape, fortran, dtype, header


def _check_member(info: zipfile.ZipInfo, shape, dtype, header: int, path: str, max_ratio: int) -> None:
    count = 1
    for d in shape:
        count *= int(d)
    want = header + count * dtype.itemsize
    name = info.filename[:80]
    if info.file_size != want:
        raise GraphmpError(f"{path}: array '{name}' claims shape {list(shape)[:8]} {dtype} ({want - header} bytes) "
                           f"but its zip member holds {info.file_size - header}; the file is corrupt or forged. "
                           "Save it again with numpy.savez")
    if info.file_size > RATIO_FROM and info.file_size > max_ratio * max(info.compress_size, 1):
        raise GraphmpError(f"{path}: array '{name}' inflates {info.file_size // max(info.compress_size, 1)}x "
                           f"({info.compress_size} -> {info.file_size} bytes), over the limit of {max_ratio}x for "
                           f"members over {RATIO_FROM >> 20} MiB (a zip bomb?). Save it with numpy.savez "
                           f"(uncompressed), or raise {MAX_RATIO_ENV}")


def read_npy(path: str, what: str = ".npy") -> np.ndarray:
    """The array of the .npy file at `path`, its header checked first against the file's size
    and MAX_BYTES (a header claiming 58 TiB is an error, not an allocation), or a one-line
    GraphmpError naming the file."""
    max_bytes = _limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(f)
            count = 1
            for d in shape:
                count *= int(d)
            want = f.tell() + count * dtype.itemsize
            size = os.fstat(f.fileno()).st_size
            if dtype.hasobject or size != want or want > max_bytes:
                raise ValueError(f"its header claims {list(shape)[:8]} {dtype} ({want} bytes with the header), the "
                                 f"file holds {size} bytes" + (f", over the limit of {max_bytes} ({MAX_BYTES_ENV})"
                                                               if want > max_bytes else ""))
            f.seek(0)
            return np.load(f, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise GraphmpError(f"{path}: not a readable {what} ({str(e)[:200]})") from None


def read_npz(path: str, what: str = ".npz", hint: str = "") -> dict:
    """All arrays of the .npz at `path` by name (member name less '.npy'), each checked
    before it is read (see the module doc), or a one-line GraphmpError naming the file.
    Needs: `path` an existing file. Memory: at most the arrays' own bytes."""
    max_bytes, max_ratio = _limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES), _limit(MAX_RATIO_ENV, DEFAULT_MAX_RATIO)
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise GraphmpError(f"{path}: is an .npy file (one unnamed array); graphmp needs an {what} with one "
                           f"array per name.{hint or ' Save one with numpy.savez(path, name=array).'}")
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise GraphmpError(f"{path}: not a readable {what} ({str(e)[:160]}).{hint}") from None
    with z:
        infos = [i for i in z.infolist() if not i.is_dir()]
        total = sum(i.file_size for i in infos)
        if total > max_bytes:
            raise GraphmpError(f"{path}: its arrays take {total} bytes uncompressed, over the limit of {max_bytes} "
                               f"bytes; split the data into several files, or raise {MAX_BYTES_ENV}")
        checked = []
        for info in infos:
            shape, fortran, dtype, header = _member_header(z, info, path, what)
            _check_member(info, shape, dtype, header, path, max_ratio)
            checked.append(info)
        out = {}
        try:
            for info in checked:
                with z.open(info) as f:
                    arr = np.lib.format.read_array(f, allow_pickle=False)
                key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                out[key] = arr
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise GraphmpError(f"{path}: not a readable {what} ({str(e)[:160]}).{hint}") from None
    return out
