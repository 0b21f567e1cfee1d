"""Runs one rank's command and ends its whole process tree with it.

Started by the rank's actor as ``python rank_guard.py PARENT_PID COMMAND...`` (run by path,
so that it imports nothing of horovod_ray, Ray or TensorFlow). It starts COMMAND with the
same output, environment and directory, and:

* adopts every process COMMAND starts, even those that outlive their parent (it is their
  subreaper), so that it can always find them;
* on SIGTERM or SIGINT, which the actor sends to end the rank, and which the kernel sends
  if the actor dies (the parent-death signal), ends the tree: SIGTERM, then SIGKILL after
  a grace period;
* is killed with the actor where Ray kills a dying worker's children outright
  (``ray.kill``): the command then gets SIGKILL from the kernel (its own parent-death
  signal), so that it does not outlive the job (what it started itself may);
* when COMMAND exits, ends whatever it left running, then exits with COMMAND's status
  (a command killed by signal N makes it die of signal N too); one that cannot start
  exits 127 (not found) or 126 (not runnable), as a shell does.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 3.0
# How often ended orphans are collected while the command runs.
REAP_EVERY_S = 2.0


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _processes() -> list[tuple[int, int, bool]]:
    """(pid, parent pid, is a zombie) of every process, from /proc."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name may hold spaces or parentheses: the fields follow the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        table.append((int(entry), int(fields[1]), fields[0] == b"Z"))
    return table


def _descendants() -> list[int]:
    """Every live process below this one (orphans come back here: we are their reaper)."""
    children: dict[int, list[int]] = {}
    for pid, parent, zombie in _processes():
        if not zombie:
            children.setdefault(parent, []).append(pid)
    found, stack = [], [os.getpid()]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _reap_orphans(command_pid: int) -> None:
    """Collects adopted processes that have ended (never the command: Popen waits for it)."""
    me = os.getpid()
    for pid, parent, zombie in _processes():
        if zombie and parent == me and pid != command_pid:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _die_with_parent() -> None:
    """In the command's process before it runs: the kernel kills it if the guard dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def end_tree(grace_s: float) -> None:
    """SIGTERM to every descendant, SIGKILL to those left after ``grace_s``."""
    _signal_all(_descendants(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _descendants():  # zombies are not counted: they have ended
            return
        time.sleep(0.05)
    _signal_all(_descendants(), signal.SIGKILL)
    while _descendants():
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # Ray's processes start with SIGINT blocked, and the mask is inherited: give the
    # command the signals a shell would.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    ending: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: ending.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: ending.append(signum))
    if os.getppid() != parent:  # the actor died before the parent-death signal was armed
        return 128 + signal.SIGTERM
    try:
        # Ray kills a dying actor's children outright (SIGKILL): the guard then cannot end
        # the tree, so the command itself dies with the guard.
        child = subprocess.Popen(command, preexec_fn=_die_with_parent)
    except OSError as err:
        print(f"horovod-ray: cannot run {command[0]!r}: {err}", file=sys.stderr, flush=True)
        # A shell's statuses: 127 not found, 126 found but not runnable.
        return 127 if isinstance(err, FileNotFoundError) else 126
    ended, next_reap = False, time.monotonic() + REAP_EVERY_S
    while True:
        if ending and not ended:
            ended = True
            end_tree(GRACE_S)
        try:
            returncode = child.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > next_reap:
            _reap_orphans(child.pid)
            next_reap = time.monotonic() + REAP_EVERY_S
    end_tree(GRACE_S)  # whatever the command left behind
    if returncode < 0:
        # Die of the same signal, so the actor sees what the command saw.
        try:
            signal.signal(-returncode, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP keep their default anyway
        os.kill(os.getpid(), -returncode)
        return 128 - returncode  # a signal whose default is not to end the process
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
