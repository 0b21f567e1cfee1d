"""Waiting for the local Ray's worker output to reach this process, so the exit need not guess.

Ray forwards what its workers print through the log monitor, a process that tails each
worker's log files and publishes new lines, to the driver's log thread, which prints
them. At interpreter exit Ray sleeps a fixed 0.5 s so that the last lines can arrive: it
cannot tell when they have, and lines still queued after 0.5 s are lost.

:func:`flush` can tell. It appends one marker line to the log files of this driver's
workers on the node (Ray opens them for appending, so no worker line is overwritten); the
log monitor reads a file in order, so once a file's marker reaches this process, every
line written to that file before it has reached it too. A filter at the front of Ray's
output handlers takes the markers out before anything is printed. The marker stays in
each worker's log file, as a line ``horovod_ray-output-flushed:<token>:<n>``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

import ray

logger = logging.getLogger(__name__)

MARKER = "horovod_ray-output-flushed:"
# The longest flush() waits for the markers; on the way to a faster exit, so short.
FLUSH_TIMEOUT_S = 2.0
# Ray's name in a worker log file for workers started before any job was given to them;
# such a file says which job it serves in a line of its own, Ray's JOB_LINE and the id.
NO_JOB = "ffffffff"
JOB_LINE = ray._private.ray_constants.LOG_PREFIX_JOB_ID  # noqa: SLF001 - ":job_id:"
# How much of such a file is read for that line: Ray writes it when the job's first task
# arrives, before any of the job's output.
HEAD_BYTES = 64 * 1024
_FILTER_NAME = "horovod_ray_output_markers"


class Markers:
    """The markers this process wrote and those that arrived; the filter's state."""

    def __init__(self) -> None:
        self._arrived = threading.Condition()
        self._seen: dict[str, set[int]] = {}

    def new_token(self) -> str:
        """A token for one flush's markers, known to :meth:`take_out` from now on."""
        token = uuid.uuid4().hex
        with self._arrived:
            self._seen[token] = set()
        return token

    def take_out(self, lines: list[str]) -> list[str]:
        """``lines`` without this process's markers, each marker noted as arrived.

        A worker's last line without a newline ends up in front of the marker: it is kept.
        """
        kept = []
        with self._arrived:
            for line in lines:
                at = line.rfind(MARKER)
                token, _, index = line[at + len(MARKER) :].partition(":")
                if at < 0 or token not in self._seen or not index.isdigit():
                    kept.append(line)
                    continue
                self._seen[token].add(int(index))
                self._arrived.notify_all()
                if line[:at]:
                    kept.append(line[:at])
        return kept

    def wait(self, token: str, count: int, timeout_s: float) -> int:
        """Waits up to ``timeout_s`` for markers ``0 .. count - 1`` of ``token``.

        Returns:
            How many of them arrived.
        """
        with self._arrived:
            self._arrived.wait_for(lambda: len(self._seen[token]) >= count, timeout_s)
            return len(self._seen[token])


_markers = Markers()


def serves_job(name: str, job: str, head: Callable[[], str]) -> bool:
    """Whether the worker log file ``name`` holds output of job ``job``.

    Ray names a worker's files ``worker-<worker id>-<job id>-<pid>.out`` (and ``.err``).
    A worker started before a job was given to it is named for no job (:data:`NO_JOB`)
    and says in the file which job it went to: only then is ``head()``, the start of the
    file, read for that line. A file of another job is never marked: Ray would send its
    marker to that job's driver, not here.
    """
    parts = os.path.basename(name).rsplit("-", 2)
    if len(parts) != 3:
        return False
    if parts[1] == job:
        return True
    return parts[1] == NO_JOB and f"{JOB_LINE}{job}" in head().splitlines()


def _take_out_markers(data: dict[str, Any]) -> None:
    data["lines"] = _markers.take_out(data.get("lines") or [])


def _dispatcher() -> Any:
    # Ray's only hook on the workers' lines; its handlers run in the order of the list.
    return ray._private.ray_logging.global_worker_stdstream_dispatcher  # noqa: SLF001


def install_filter() -> None:
    """Puts the marker filter ahead of Ray's printing handler, once per process."""
    dispatcher = _dispatcher()
    with dispatcher._lock:  # noqa: SLF001 - add_handler appends, after Ray's printer
        if all(name != _FILTER_NAME for name, _ in dispatcher.handlers):
            dispatcher.handlers = [(_FILTER_NAME, _take_out_markers), *dispatcher.handlers]


def forwarded() -> bool:
    """Whether the workers' output is printed by this process: Ray's thread that receives
    it runs (it is started, with Ray's printing handler, only for ``log_to_driver``, the
    default, and ends at ``ray.shutdown()`` or on a broken connection)."""
    thread = getattr(ray._private.worker.global_worker, "logger_thread", None)  # noqa: SLF001
    return thread is not None and thread.is_alive()


def _head(path: str) -> str:
    with open(path, "rb") as log:
        return log.read(HEAD_BYTES).decode("utf-8", "replace")


def _append(path: str, line: str) -> bool:
    """Appends ``line`` to an existing file; False if it is gone (never creates it: Ray's
    log monitor moves the files of dead workers away and would not read a new one)."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        return False
    try:
        os.write(descriptor, line.encode("utf-8"))
    finally:
        os.close(descriptor)
    return True


def flush(logs_dir: str, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Waits until what this driver's workers on the node whose logs are in ``logs_dir``
    have written so far has reached this process.

    Args:
        logs_dir: The node's log folder (``Node.get_logs_dir_path()``).
        timeout_s: The longest wait.

    Returns:
        True if it all arrived within ``timeout_s``, or nothing is forwarded here; False
        if some marker had not arrived by then.
    """
    if not forwarded():
        return True
    install_filter()
    started = time.monotonic()
    job = ray.get_runtime_context().get_job_id()
    token = _markers.new_token()
    with os.scandir(logs_dir) as entries:
        paths = [
            entry.path
            for entry in entries
            if entry.name.startswith("worker-") and entry.name.endswith((".out", ".err"))
        ]
    written = 0
    for path in paths:
        try:
            if not serves_job(path, job, functools.partial(_head, path)):
                continue
        except OSError:
            continue  # moved away meanwhile: its worker is gone
        if _append(path, f"{MARKER}{token}:{written}\n"):
            written += 1
    arrived = _markers.wait(token, written, timeout_s)
    logger.debug(
        "%d of %d workers' log files flushed to this process in %.3f s",
        arrived,
        written,
        time.monotonic() - started,
    )
    return arrived >= written
