"""``horovod-ray run``'s answer to SIGUSR1: the Python stacks of every rank's command
(both halves).

A command runs in processes of its own, not in the rank's actor, so its stacks are read
from outside with py-spy (which Ray's ``default`` extra installs), one process at a time:
py-spy stops a process for the few milliseconds the reading takes, then lets it go on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import IO, TYPE_CHECKING, Callable

import psutil

from horovod_ray.cli import command

if TYPE_CHECKING:
    from horovod_ray.cli.signals import Signals
    from horovod_ray.executor import RayExecutor

# Longest one process's reading may take (py-spy needs tens of milliseconds); the relay
# of every rank's output waits meanwhile.
PY_SPY_TIMEOUT_S = 5.0
_NO_PY_SPY = "py-spy is not installed on this node (pip install py-spy, or ray[default])"
# What py-spy needs where Ray does not run as root: the kernel's ptrace permission.
_NOT_ALLOWED = (
    "py-spy may not read this process: run Ray as root, or give its nodes CAP_SYS_PTRACE "
    "or kernel.yama.ptrace_scope=0"
)


def py_spy() -> str | None:
    """py-spy beside this Python (its environment's ``bin``), else on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def process_stacks(pid: int, tool: str) -> str:
    """One process's Python stacks as py-spy prints them, or the one line that says why
    there are none (not a Python process, gone, not allowed)."""
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )
    except subprocess.TimeoutExpired:
        return f"no stacks: py-spy took more than {PY_SPY_TIMEOUT_S:g}s"
    if done.returncode == 0:
        return done.stdout.rstrip("\n")
    reason = (done.stderr.strip() or done.stdout.strip() or "py-spy failed").splitlines()[0]
    if "Permission denied" in reason or "Operation not permitted" in reason:
        return f"no stacks: {_NOT_ALLOWED} ({reason.removeprefix('Error: ')})"
    return f"no Python stacks ({reason.removeprefix('Error: ')})"


def stacks_on_rank() -> str:
    """Runs in the rank's actor: each process of this rank's command (not the guard),
    with its command line and its stacks."""
    guard = command.command_pid()
    if guard is None:
        return "no command runs on this rank"
    try:
        processes = psutil.Process(guard).children(recursive=True)
    except psutil.NoSuchProcess:
        return "the command has exited"
    tool = py_spy()
    parts = []
    for process in processes:
        try:
            line = " ".join(process.cmdline())
        except psutil.Error:
            continue  # it exited meanwhile
        text = process_stacks(process.pid, tool) if tool else _NO_PY_SPY
        parts.append(f"pid {process.pid}: {line}\n{text}")
    return "\n".join(parts) or "the command has exited"


def print_stacks(executor: RayExecutor, stream: IO[str]) -> None:
    """Asks every rank of a started static ``executor`` for its command's stacks and
    writes them to ``stream``, each line prefixed ``[RANK]<stacks>:``."""
    texts = executor.run(stacks_on_rank)
    lines = [
        f"[{rank}]<stacks>:{line}\n"
        for rank, text in enumerate(texts)
        for line in text.splitlines()
    ]
    stream.write("".join(lines))
    stream.flush()


def after_poll(executor: RayExecutor, signals: Signals) -> Callable[[], int | None]:
    """What a static ``horovod-ray run`` does between its polls of the ranks: prints their
    stacks to stderr after SIGUSR1, and says which signal asked it to stop (None: none)."""

    def answer() -> int | None:
        if signals.take_stacks_request():
            print("horovod-ray run: every rank's stacks (SIGUSR1)", file=sys.stderr)
            print_stacks(executor, sys.stderr)
        return signals.received

    return answer
