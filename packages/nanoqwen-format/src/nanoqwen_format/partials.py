"""The writer's temporary files: their name, their mode, their lock, and the ones a killed writer left.

`Writer(path)` streams into `NAME.partial-PID-RANDOM` in the folder of `path` (NAME is the file name
of `path`, PID the writer's process id, RANDOM 8 hex digits), so `ls NAME*` shows a write in progress.
The file is created with mode 0o666 and the kernel applies the process umask, exactly as for a file
`open()` creates: the renamed container gets 0666 & ~umask. The writer holds an exclusive `flock`
on it until it is renamed into place or removed; the kernel drops that lock when the process dies,
whatever kills it.

Before it creates its own, the writer looks at every `NAME.partial-*` and `.NAME.*.partial` (the
hidden name of an older writer's partial files) next to `path`:

    state    what                                                what the writer does
    live     someone holds its lock: a write to NAME is running  refuses: ConcurrentWriteError
    stale    no lock, and process PID is gone (or a zombie)      removes it and reports it
    unknown  no lock, but process PID exists (its PID was        leaves it alone and reports it
             reused, or its writer is between creating and
             locking it); or an old hidden temp file (no PID)

Two writers that open the same path in the same instant can both miss each other: both write, and
the last rename wins; the file under NAME is always one complete container. Without locks (no
`fcntl` module, or a file system that refuses them) a file is judged by its PID alone and is never
removed while that process exists. On a network file system the lock protects writers on other
machines only where the file system shows it to them (Linux's NFS client does, with byte-range
locks); the PID is only meaningful on the machine that checks it.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from dataclasses import dataclass

from .errors import ConcurrentWriteError

try:
    import fcntl
except ImportError:  # not POSIX: no locks; files are judged by PID only
    fcntl = None

__all__ = ["PartialFile", "PartialFileWarning", "clean_partials", "create_partial", "partial_pattern"]

PARTIAL_INFIX = ".partial-"


class PartialFileWarning(UserWarning):
    """A temporary file of an earlier write to the same path was removed, or found and left alone."""


@dataclass(frozen=True)
class PartialFile:
    """A writer's temporary file found next to an output path, and what was done with it.

    state: "stale" (its writer is dead), "unknown" (cannot tell; left alone) or "live" (being written).
    removed: the file was deleted. `str()` is a one-line report for a log or a warning."""

    path: str
    pid: int | None  # None: the hidden temp file of an older writer, which carries no PID
    nbytes: int
    state: str
    removed: bool = False
    reason: str = ""

    def __str__(self) -> str:
        name = f"{os.path.basename(self.path)} ({_size(self.nbytes)})"
        if self.removed:
            return f"removed the stale temp file {name} of an interrupted write: {self.reason}"
        return f"left the temp file {name} alone: {self.reason}"


def partial_pattern(path: str | os.PathLike) -> re.Pattern:
    """The regular expression a temp file name of a write to `path` matches (group 1: the PID)."""
    return re.compile(re.escape(os.path.basename(os.fspath(path)) + PARTIAL_INFIX) + r"(\d+)-[0-9A-Za-z]+")


def create_partial(path: str | os.PathLike) -> tuple[int, str]:
    """Create and lock a new temp file for a write to `path`: (fd open for writing, temp path).

    Mode 0o666 minus the umask, applied by the kernel; O_EXCL, so an existing file is never reused."""
    path = os.path.abspath(os.fspath(path))
    folder, base = os.path.split(path)
    while True:
        tmp = os.path.join(folder, f"{base}{PARTIAL_INFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:  # 2**32 names per PID: only a leftover of a recycled PID gets here
            continue
        _try_lock(fd)
        return fd, tmp


def clean_partials(path: str | os.PathLike) -> list[PartialFile]:
    """Remove the stale temp files of earlier writes to `path`; refuse if a write to it is running.

    Returns the files removed or left alone (see the module docstring), each with a one-line `str()`.
    Raises ConcurrentWriteError, after removing the stale ones, when a temp file is locked by a live
    writer. Other files in the folder are never touched. OSError when the folder cannot be listed."""
    path = os.path.abspath(os.fspath(path))
    folder, base = os.path.split(path)
    ours = partial_pattern(path)
    legacy = re.compile(re.escape("." + base + ".") + r"[^/]+\.partial")
    found: list[PartialFile] = []
    live: list[PartialFile] = []
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries if e.is_file(follow_symlinks=False))
    for name in names:
        m = ours.fullmatch(name)
        if m:
            p = _judge(os.path.join(folder, name), int(m.group(1)), base)
        elif legacy.fullmatch(name):
            p = _judge(os.path.join(folder, name), None, base)
        else:
            continue
        if p is None:  # vanished while we looked
            continue
        (live if p.state == "live" else found).append(p)
    if live:
        p = live[0]
        raise ConcurrentWriteError(
            f"another write to this file is running (process {p.pid}, temp file "
            f"{os.path.basename(p.path)}, {_size(p.nbytes)} so far); wait for it to finish or stop it",
            path=path,
        )
    return found


def _judge(tmp: str, pid: int | None, base: str) -> PartialFile | None:
    """Classify one temp file; remove it when it is stale. None when it disappeared meanwhile."""
    advice = f"delete it if no write to {base} is running"
    try:
        fd = _open_for_lock(tmp)
    except FileNotFoundError:
        return None
    except OSError as e:  # e.g. another user's file that we may not open: never removed
        return PartialFile(tmp, pid, _lstat_size(tmp), "unknown",
                           reason=f"it cannot be opened ({e.strerror}); {advice}")
    try:
        nbytes = os.fstat(fd).st_size
        if pid is None:  # the old writer neither named its process nor locked its file
            return PartialFile(tmp, None, nbytes, "unknown",
                               reason=f"a temp file of an older nanoqwen writer; {advice}")
        if _try_lock(fd) is False:
            return PartialFile(tmp, pid, nbytes, "live", reason=f"a write by process {pid} is running")
        if _pid_alive(pid):  # a reused PID, a writer that has not locked its file yet, or no locks here
            return PartialFile(tmp, pid, nbytes, "unknown",
                               reason=f"process {pid} exists but holds no lock on it; {advice}")
        try:
            os.unlink(tmp)  # while we hold its lock: no writer can have taken it meanwhile
        except FileNotFoundError:
            return None
        except OSError as e:
            return PartialFile(tmp, pid, nbytes, "stale",
                               reason=f"process {pid} is gone but the file cannot be removed ({e.strerror})")
        return PartialFile(tmp, pid, nbytes, "stale", removed=True, reason=f"process {pid} is gone")
    finally:
        os.close(fd)  # releases our lock


def _open_for_lock(tmp: str) -> int:
    # read-write: NFS emulates flock with byte-range locks, which need write access for LOCK_EX
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        return os.open(tmp, os.O_RDWR | flags)
    except PermissionError:
        return os.open(tmp, os.O_RDONLY | flags)


def _try_lock(fd: int) -> bool | None:
    """flock(LOCK_EX | LOCK_NB): True when taken, False when another open file holds it, None when
    locks are unavailable here (no fcntl, or the file system refuses them)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None
    return True


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine and is not a zombie. Not POSIX: assume it does."""
    if os.name != "posix":
        return True
    if pid <= 0:  # 0 and negatives address process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")  # a zombie holds no files and no locks
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill said it exists


def _lstat_size(tmp: str) -> int:
    try:
        return os.lstat(tmp).st_size
    except OSError:
        return 0


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} byte{'' if n == 1 else 's'}"
