"""What a process leaves in its node's temporary folder, and sweeping what processes that
are gone left there.

A folder or file is named a prefix, its process's id, ``-`` and a suffix (:func:`owned`);
a process killed with its job never runs the code that removes it, so the next process
of this package on the node removes it (:func:`sweep_stale`). Whether its process is
gone is not told by its id alone: a container sharing the node's temporary folder has a
process-id space of its own, where the same number is another process (or none). So a
process that names something after itself first takes a lock on a file of its own
(``horovod_ray-alive-<pid>-<random>``), held until it exits: the kernel releases it then,
whatever the namespace. A number with a held lock is alive; with lock files but none
held, gone; with none at all (a folder named by an older version of this package), its
process is looked for by number, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile
import threading

ALIVE_PREFIX = "horovod_ray-alive-"

_lock = threading.Lock()
_held: tuple[int, int] | None = None  # (pid, descriptor) of this process's lock


def owned(prefix: str) -> str:
    """``prefix``, this process's id and ``-``: the start of a name that
    :func:`sweep_stale` leaves alone while this process lives."""
    hold_alive_lock()
    return f"{prefix}{os.getpid()}-"


def hold_alive_lock(root: str | None = None) -> None:
    """Takes this process's lock (once; a forked child takes its own)."""
    global _held
    with _lock:
        if _held is not None and _held[0] == os.getpid():
            return
        root = tempfile.gettempdir() if root is None else root
        pid = os.getpid()
        # Locked under a name no sweep reads, then renamed: a sweep never finds it unlocked.
        descriptor, locking = tempfile.mkstemp(prefix=f"{ALIVE_PREFIX}new-{pid}-", dir=root)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        path = locking.replace(f"{ALIVE_PREFIX}new-", ALIVE_PREFIX, 1)
        os.rename(locking, path)
        _held = pid, descriptor
        atexit.register(_remove, path, pid)


def _remove(path: str, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child's exit: the lock is its parent's
    with contextlib.suppress(OSError):
        os.remove(path)


def sweep_stale(prefixes: tuple[str, ...], root: str | None = None) -> list[str]:
    """Removes the folders and files under ``root`` (the temporary folder by default)
    named after a process that is gone (see the module), and the lock files such
    processes left. Returns the names removed."""
    root = tempfile.gettempdir() if root is None else root
    names = os.listdir(root)
    alive = _alive_by_locks(root, names)
    removed = []
    for name in names:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        pid = name[len(prefix) :].split("-", 1)[0] if prefix else ""
        if not pid.isdigit() or alive.get(int(pid), _alive(int(pid))):
            continue
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                continue
        removed.append(name)
    return removed


def _alive_by_locks(root: str, names: list[str]) -> dict[int, bool]:
    """For each process id with lock files in ``root``: whether one of them is held. A
    lock file no process holds is removed."""
    alive: dict[int, bool] = {}
    for name in names:
        pid = name[len(ALIVE_PREFIX) :].split("-", 1)[0] if name.startswith(ALIVE_PREFIX) else ""
        if not pid.isdigit():
            continue
        held = _held_by_someone(os.path.join(root, name))
        alive[int(pid)] = alive.get(int(pid), False) or held
    return alive


def _held_by_someone(path: str) -> bool:
    if _held is not None and _held[0] == os.getpid():
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(_held[1]), os.stat(path)):
                return True  # this process's own (a second flock here would succeed)
    try:
        descriptor = os.open(path, os.O_RDWR)
    except PermissionError:
        return True  # another user's process: left alone, as by number
    except OSError:
        return False  # removed meanwhile: its process ended
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    with contextlib.suppress(OSError):
        os.remove(path)  # nobody holds it: its process is gone
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
