"""A command, not a Python function, on every rank: both halves of ``horovod-ray run``.

On the rank, :func:`start_on_rank` runs the command under a guard process
(``rank_guard.py``) as a child of the rank's actor, with the rank's Horovod environment,
so that ``hvd.init()`` in an unmodified script joins the job; :func:`poll_on_rank` hands
back its output lines and its exit, and :func:`end_on_rank` ends its process tree. The
guard adopts every process the command starts and ends them all when the command exits,
when asked to, or when the actor dies, so no rank process outlives its rank.

On the driver, :class:`CommandJob` runs those through a :class:`RayExecutor` (each round
trip a short ``run()``, so failures keep the executor's attribution) and writes every
line with horovodrun's prefix, ``[RANK]<stdout>:`` or ``[RANK]<stderr>:``.
"""

from __future__ import annotations

import atexit
import codecs
import collections
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable

import psutil
import ray

from horovod_ray.cli.output import Output
from horovod_ray.settings import MANAGED_ENV, STALL_SHUTDOWN_ENV, STALL_WARNING_ENV

# Longest one poll waits on a rank for output before it answers with none.
POLL_S = 0.2
# Seconds a rank's process tree gets between SIGTERM and SIGKILL (the guard's own).
END_GRACE_S = 3.0
# More time the guard gets to report its exit before it is killed with its tree.
GUARD_EXTRA_S = 2.0
# Most characters of output a rank holds for the driver: past that it stops reading the
# pipes, so a command that prints faster than the driver reads blocks in its writes (as
# under horovodrun), and the actor and the driver (one poll's worth a rank) stay bounded.
MAX_QUEUED_CHARS = 1 << 20
# After the command exits, how long its output may stay open (a background child holding
# the pipe) before the exit is reported anyway.
PIPE_LINGER_S = 1.0
# Set in the child: Ray's GPU assignment travels in the actor's environment.
_FROM_ACTOR = MANAGED_ENV | {"CUDA_VISIBLE_DEVICES"}
# Set in the child unless ``--env`` names it: the rank's interface wins over the caller's,
# as horovodrun's command line prefix does.
# HOROVOD_TIMELINE: --timeline-filename's file on rank 0's node, which the job brings back.
_FROM_ACTOR_UNLESS_GIVEN = frozenset({"NCCL_SOCKET_IFNAME", "HOROVOD_TIMELINE"})
# The job's defaults: the caller's own values and the flags (--stall-check-*) win.
_DEFAULTS_FROM_ACTOR = frozenset({STALL_WARNING_ENV, STALL_SHUTDOWN_ENV})
# The caller's variables horovodrun does not pass on either.
_NOT_PASSED = re.compile(r"BASH_FUNC_.*|OLDPWD|HOROVOD_SECRET_KEY")
# Runs each command and ends its tree with it; by path, so it imports nothing heavy.
GUARD = str(Path(__file__).with_name("rank_guard.py"))
_LINE_END = re.compile(r"(?<=[\r\n])")


def split_lines(pending: str, text: str) -> tuple[list[str], str]:
    """Complete lines (each with its ``\\n`` or ``\\r``) in ``pending + text``, and the rest.

    A ``\\r`` ends a line as horovodrun's output does, so progress bars reach the driver
    as they redraw. Only ``text`` is searched, so a long line costs linear time.
    """
    pieces = _LINE_END.split(text)
    if len(pieces) == 1:
        return [], pending + text
    pieces[0] = pending + pieces[0]
    return pieces[:-1], pieces[-1]


@dataclasses.dataclass(frozen=True)
class Exit:
    """How a rank's command ended."""

    returncode: int  # as subprocess reports it: -N for signal N
    at: float  # wall-clock time of the exit, on the rank's node

    @property
    def status(self) -> int:
        """The shell's exit status: the code, or 128 + the signal."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name} (status {self.status})"
        return f"exited with status {self.returncode}"


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a rank's command runs."""

    node_ip: str
    hostname: str
    pid: int
    cwd: str


class RankProcess:
    """One rank's command: its child process, the threads that read it, its output queue."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self._ready = threading.Condition()
        self._lines: collections.deque[tuple[str, str]] = collections.deque()
        self._queued_chars = 0
        self._readers_waiting = 0  # readers with lines in hand, waiting for room
        self._open_pipes = 2
        self._exit: Exit | None = None
        self._exited_at = 0.0
        self._process = subprocess.Popen(
            [sys.executable, "-I", GUARD, str(os.getpid()), *argv],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Ctrl-C at a terminal that runs a local Ray must not reach it directly.
            start_new_session=True,
        )
        self.pid = self._process.pid
        for pipe, stream in ((self._process.stdout, "stdout"), (self._process.stderr, "stderr")):
            threading.Thread(target=self._read, args=(pipe, stream), daemon=True).start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self, pipe: IO[bytes], stream: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        fd = pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            text = decoder.decode(chunk, final=not chunk)
            lines, pending = split_lines(pending, text)
            if not chunk and pending:
                lines.append(pending + "\n")
            with self._ready:
                if self._queued_chars >= MAX_QUEUED_CHARS:
                    self._readers_waiting += 1
                    self._ready.wait_for(lambda: self._queued_chars < MAX_QUEUED_CHARS)
                    self._readers_waiting -= 1
                self._lines.extend((stream, line) for line in lines)
                self._queued_chars += sum(map(len, lines))
                if not chunk:
                    self._open_pipes -= 1
                self._ready.notify_all()
            if not chunk:
                pipe.close()
                return

    def _wait(self) -> None:
        returncode = self._process.wait()
        with self._ready:
            self._exit = Exit(returncode, time.time())
            self._exited_at = time.monotonic()
            self._ready.notify_all()

    def _finished(self) -> bool:
        if self._exit is None or self._readers_waiting:
            return False
        return self._open_pipes == 0 or time.monotonic() - self._exited_at > PIPE_LINGER_S

    def poll(self, timeout_s: float) -> tuple[list[tuple[str, str]], Exit | None]:
        """Waits up to ``timeout_s`` for output; returns the lines queued and, once every
        line has been handed over, the exit."""
        with self._ready:
            self._ready.wait_for(lambda: self._lines or self._finished(), timeout_s)
            lines = list(self._lines)
            self._lines.clear()
            self._queued_chars = 0
            self._ready.notify_all()  # readers waiting for room go on
            return lines, self._exit if self._finished() else None

    def end(self, grace_s: float, wait: bool = True) -> None:
        """Ends the command's whole tree: the guard gets SIGTERM and ends it (SIGTERM, then
        SIGKILL after its grace period); a guard that does not exit in time is killed with
        everything below it. Without ``wait``, that watch runs in a thread, so that polls
        go on draining the command's output meanwhile."""
        with self._ready:
            if self._exit is not None:
                return
            tree = _tree(self.pid)
            try:
                self._process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                return
        if wait:
            self._kill_if_alive(tree, grace_s)
        else:
            threading.Thread(target=self._kill_if_alive, args=(tree, grace_s), daemon=True).start()

    def _kill_if_alive(self, tree: list[psutil.Process], grace_s: float) -> None:
        with self._ready:
            if self._ready.wait_for(lambda: self._exit is not None, grace_s + GUARD_EXTRA_S):
                return
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# The command this actor runs; one per rank, one rank per actor.
_process: RankProcess | None = None


def child_env(caller_env: dict[str, str], extra_env: dict[str, str]) -> dict[str, str]:
    """The command's environment: the caller's, then ``--env``, then the rank's own."""
    env = {key: os.environ[key] for key in _DEFAULTS_FROM_ACTOR if key in os.environ}
    env.update(
        (key, value)
        for key, value in caller_env.items()
        if key not in _FROM_ACTOR and not _NOT_PASSED.fullmatch(key)
    )
    env.update({key: os.environ[key] for key in _FROM_ACTOR_UNLESS_GIVEN if key in os.environ})
    env.update(extra_env)
    env.update({key: os.environ[key] for key in _FROM_ACTOR if key in os.environ})
    # As horovodrun: Python ranks write to a pipe, which would otherwise hold their lines.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_on_rank(
    argv: list[str],
    caller_env: dict[str, str],
    extra_env: dict[str, str],
    caller_cwd: str,
    shipped_cwd: bool,
) -> Where:
    """Starts the command on this rank (runs in the rank's actor).

    The child starts in ``caller_cwd`` where that directory exists (always on the caller's
    own node, as horovodrun does over SSH), else in the actor's; with a shipped working
    directory (``--working-dir``), in the actor's, which Ray set to the shipped copy.
    """
    global _process
    if _process is not None:
        raise RuntimeError("this rank already runs a command")
    cwd = os.getcwd() if shipped_cwd or not os.path.isdir(caller_cwd) else caller_cwd
    _process = RankProcess(argv, child_env(caller_env, extra_env), cwd)
    # The actor's exit (stop(), a failed job) ends the command's tree too; if the actor is
    # killed outright, the guard gets the kernel's parent-death signal and does the same.
    atexit.register(_process.end, END_GRACE_S)
    return Where(ray.util.get_node_ip_address(), socket.gethostname(), _process.pid, cwd)


def poll_on_rank(timeout_s: float) -> tuple[list[tuple[str, str]], Exit | None]:
    """This rank's new output lines, and its exit once all of it was handed over."""
    if _process is None:
        return [], None
    return _process.poll(timeout_s)


def command_pid() -> int | None:
    """The pid of this rank's guard, the command's parent; None before the command."""
    return None if _process is None else _process.pid


def end_on_rank(grace_s: float) -> None:
    """Starts ending this rank's command and everything it started (returns at once)."""
    if _process is not None:
        _process.end(grace_s, wait=False)


# --------------------------------------------------------------------------- driver


class CommandJob:
    """Runs one command on every rank of a started executor and relays its output.

    Args:
        executor: A started :class:`RayExecutor`.
        output: Where the ranks' lines go.
        after_poll: Called after every poll (the CLI answers SIGUSR1 there); returns
            the signal number once the user asked to stop (Ctrl-C, SIGTERM), else None.
    """

    def __init__(self, executor, output: Output, after_poll: Callable[[], int | None]):
        self._executor = executor
        self._output = output
        self._after_poll = after_poll
        self.where: list[Where] = []
        self.exits: dict[int, Exit] = {}

    def run(
        self,
        argv: list[str],
        caller_env: dict[str, str],
        extra_env: dict[str, str],
        caller_cwd: str,
        shipped_cwd: bool,
    ) -> int | None:
        """Runs the command to its end on every rank.

        Returns:
            The first failing rank, or None.
        """
        executor = self._executor
        self._output.open(executor.num_workers)
        self.where = executor.run(
            start_on_rank, args=(argv, caller_env, extra_env, caller_cwd, shipped_cwd)
        )
        ending = False
        while len(self.exits) < len(self.where):
            for rank, (lines, done) in enumerate(executor.run(poll_on_rank, args=(POLL_S,))):
                self._output.write(rank, lines)
                if done is not None:
                    self.exits[rank] = done
            if not ending and (self._after_poll() is not None or self.first_failure() is not None):
                # The user asked to stop, or a rank failed: end every rank's tree, then keep
                # relaying until each has exited and its output is all out.
                ending = True
                executor.run(end_on_rank, args=(END_GRACE_S,))
        return self.first_failure()

    def first_failure(self) -> int | None:
        """The rank whose command failed first (by the nodes' clocks; ties: lowest rank)."""
        failed = [(done.at, rank) for rank, done in self.exits.items() if done.returncode]
        return min(failed)[1] if failed else None
