"""One process per run folder: `run_lock(run_dir, what)` holds an advisory lock
(fcntl.flock on RUN_DIR/.graphmp.lock) for the whole of a `train` or `export`.

- A second graphmp on the same folder is refused at once, in one line naming the pid that
  holds the lock (exit 2), before it reads or writes anything of the run.
- The kernel releases a flock when its holder dies (SIGKILL, power loss included), so a
  lock file left by a killed run never blocks the next one; the file itself stays (it
  holds only the last holder's pid).
- Data-parallel runs: the `--nproc` launcher takes the lock for its ranks and says so in
  LOCK_ENV; a rank of it does not lock again. Under a torchrun the user started, rank 0
  takes the lock and the other ranks never lock (none of them waits on another).
- The lock file is opened without following a symlink (O_NOFOLLOW) and must be a regular
  file: a run folder may come from anyone. A folder where the lock file cannot be created
  (read-only: an export of a shared run) is used without a lock; nothing can write it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat

from ..errors import GraphmpError

LOCK_NAME = ".graphmp.lock"
LOCK_ENV = "GRAPHMP_RUN_LOCK"  # the real path of the run folder whose lock the --nproc launcher holds


def _holder(fd: int) -> str:
    """The pid written in the lock file by its holder ('unknown' when unreadable)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _open_lock_file(run_dir: str) -> int | None:
    """A descriptor of the run folder's lock file (created when missing), or None when the
    folder cannot hold one (read-only)."""
    path = os.path.join(run_dir, LOCK_NAME)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            return None
        if e.errno == errno.ELOOP:
            raise GraphmpError(f"{path}: the run folder's lock file is a symlink; graphmp never follows one in a "
                               f"run folder. Remove it and run again") from None
        raise GraphmpError(f"{path}: cannot open the run folder's lock file ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GraphmpError(f"{path}: the run folder's lock file is not a regular file; remove it and run again")
    return fd


@contextlib.contextmanager
def run_lock(run_dir, what: str):
    """Hold the run folder's lock while the body runs (see the module doc). what: the
    command, for the message ('train', 'export'). A folder that does not exist is left to
    the command's own error."""
    import fcntl
    run_dir = os.fspath(run_dir)
    rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None  # a torchrun rank (distributed.world)
    inherited = os.environ.get(LOCK_ENV) == os.path.realpath(run_dir)
    if inherited or (rank is not None and rank != "0") or not os.path.isdir(run_dir):
        yield
        return
    fd = _open_lock_file(run_dir)
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GraphmpError(f"{run_dir}: another graphmp (pid {_holder(fd)}) is using this run folder; "
                               f"wait for it to finish (or stop it), then run `graphmp {what}` again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def launcher_lock(run_dir, what: str):
    """run_lock for the `--nproc` launcher: held while its ranks run, and named in LOCK_ENV
    so that they (its children) do not take it again."""
    with run_lock(run_dir, what):
        before = os.environ.get(LOCK_ENV)
        os.environ[LOCK_ENV] = os.path.realpath(os.fspath(run_dir))
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(LOCK_ENV, None)
            else:
                os.environ[LOCK_ENV] = before
