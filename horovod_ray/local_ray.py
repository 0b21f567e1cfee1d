"""The local Ray that ``run()`` and ``horovod-ray run`` start when none is running.

Only what a one-off job needs, and a faster stop: see docs/benchmarks.rst, B8.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import ray

from horovod_ray import worker_output

logger = logging.getLogger(__name__)

# Without the dashboard (about 0.7 s of Ray's start). A user who wants it, or Ray's state
# API, calls ray.init() before horovod_ray does. Workers at niceness 0, as horovodrun's
# ranks run, not Ray's default 15: a rank at 15 loses the CPU to anything else on the
# machine, Ray's own daemons included (docs/benchmarks.rst, "Rank priority").
OPTIONS: dict[str, Any] = {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}
# Whether start() ran in this process: only then does the exit hook below act.
_started = False


def start(**options: Any) -> None:
    """Starts a new local Ray instance (never joins one already on the machine), its
    workers at normal priority.

    It is stopped when the interpreter exits, as for any ``ray.init()``, but sooner:
    the autoscaler monitor is stopped first (a second shorter), and instead of Ray's
    fixed 0.5 s sleep for the workers' last lines, the exit waits until they have
    arrived (see :mod:`horovod_ray.worker_output`). That exit hook is the process's: it
    also serves a local Ray started later by a plain ``ray.init()``.
    """
    global _started
    ray.init(address="local", **{**OPTIONS, **options})
    _started = True


def stop() -> None:
    """Stops the local Ray that ``start`` began."""
    stop_monitor()
    ray.shutdown()


def _at_exit() -> None:
    """Stops the local Ray this process started once the workers' output is all here.

    Ray's own exit hook then finds nothing to do. If some output has not arrived within
    worker_output.FLUSH_TIMEOUT_S, Ray's hook stops it as usual, after its 0.5 s sleep.
    """
    node = ray._private.worker._global_node  # noqa: SLF001 - Ray has no public handle
    if not _started or node is None or not node.is_head() or not ray.is_initialized():
        return  # nothing started here, a Ray this process joined, or Ray Client
    flushed = False
    try:
        flushed = worker_output.flush(node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - at exit, Ray's own hook is the fallback
        logger.debug("waiting for the workers' last lines failed", exc_info=True)
    finally:
        stop_monitor(node)
    if flushed:
        ray.shutdown()


# Registered on import, which comes after Ray's own hook is registered (on Ray's import),
# so that it runs just before Ray's: atexit runs hooks last registered first. A user's
# hook registered later still finds Ray running.
atexit.register(_at_exit)


def stop_monitor(node: Any = None) -> None:
    """Ends the autoscaler monitor of a Ray head this process started, ahead of its stop.

    ``ray.shutdown()`` (and ``Cluster.shutdown()``) stop the GCS before the monitor. The
    monitor's SIGTERM handler then writes its exit to the GCS that is gone, and hangs
    until Ray kills it a second later. A Ray about to stop has no use for its monitor, so
    it is killed at once. ``node`` is a ``ray._private.node.Node`` (a
    ``Cluster.head_node``); by default, the Ray that ``ray.init`` started in this
    process. Nothing happens when this process joined a Ray it did not start.
    """
    if node is None:
        node = ray._private.worker._global_node  # noqa: SLF001 - Ray has no public handle
    if node is not None and node.is_head():
        node.kill_monitor(check_alive=False)
