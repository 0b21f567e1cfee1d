"""Waiting for the local Ray's worker output to reach this process, so the exit need not guess.

Ray forwards what its workers print through the log monitor, a process that tails each
worker's log files and publishes new lines, to the driver's log thread, which prints
them. At interpreter exit Ray sleeps a fixed 0.5 s so that the last lines can arrive: it
cannot tell when they have, and lines still queued after 0.5 s are lost.

:func:`flush` can tell. It appends one marker line to each worker log file of the node
(Ray opens them for appending, so no worker line is overwritten); the log monitor reads a
file in order, so once a file's marker reaches this process, every line written to that
file before it has reached it too. A filter at the front of Ray's output handlers takes
the markers out before anything is printed. The marker stays at the end of each worker's
log file, as one line ``horovod_ray-output-flushed:<token>:<n>``.
"""

from __future__ import annotations

import glob
import os
import threading
import uuid
from typing import Any

import ray

MARKER = "horovod_ray-output-flushed:"
# The longest flush() waits for the markers; on the way to a faster exit, so short.
FLUSH_TIMEOUT_S = 2.0
_FILTER_NAME = "horovod_ray_output_markers"
# Ray's name for its handler that prints workers' lines: present only while they are
# forwarded to this process (ray.init(log_to_driver=True), the default).
_RAY_PRINT_HANDLER = "ray_print_logs"


class Markers:
    """The markers this process wrote and those that arrived; the filter's state."""

    def __init__(self) -> None:
        self._arrived = threading.Condition()
        self._tokens: set[str] = set()
        self._seen: dict[str, set[int]] = {}

    def new_token(self) -> str:
        token = uuid.uuid4().hex
        with self._arrived:
            self._tokens.add(token)
            self._seen[token] = set()
        return token

    def take_out(self, lines: list[str]) -> list[str]:
        """``lines`` without this process's markers, each marker noted as arrived.

        A worker's last line without a newline ends up in front of the marker: it is kept.
        """
        kept = []
        with self._arrived:
            for line in lines:
                at = line.find(MARKER)
                token, _, index = (
                    line[at + len(MARKER) :].partition(":") if at >= 0 else ("", "", "")
                )
                if token not in self._tokens or not index.isdigit():
                    kept.append(line)
                    continue
                self._seen[token].add(int(index))
                self._arrived.notify_all()
                if line[:at]:
                    kept.append(line[:at])
        return kept

    def wait(self, token: str, count: int, timeout_s: float) -> bool:
        """Whether markers ``0 .. count - 1`` of ``token`` arrived within ``timeout_s``."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self._seen[token]) >= count, timeout_s)


_markers = Markers()


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
    """Whether the workers' output is printed by this process (Ray's log_to_driver)."""
    return any(name == _RAY_PRINT_HANDLER for name, _ in _dispatcher().handlers)


def flush(logs_dir: str, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
    """Waits until what the workers of the node whose logs are in ``logs_dir`` have written
    so far reached this process; True if it did within ``timeout_s`` (or nothing is
    forwarded here), False if some marker had not arrived by then.

    Only worker log files of this driver's job, or of workers started for no job yet, are
    marked: Ray does not send this process the lines of another driver's workers.
    """
    if not forwarded():
        return True
    install_filter()
    job = ray.get_runtime_context().get_job_id()
    files = [
        path
        for path in glob.glob(os.path.join(logs_dir, "worker-*-*-*.out"))
        + glob.glob(os.path.join(logs_dir, "worker-*-*-*.err"))
        if path.rsplit("-", 2)[-2] in (job, "ffffffff")
    ]
    token = _markers.new_token()
    written = 0
    for path in files:
        try:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{MARKER}{token}:{written}\n")
            written += 1
        except OSError:
            continue  # a file Ray moved away meanwhile: its worker is gone
    return _markers.wait(token, written, timeout_s)
