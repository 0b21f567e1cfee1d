"""The local Ray that ``run()`` and ``horovod-ray run`` start when none is running.

Only what a one-off job needs, and a faster stop: see docs/benchmarks.rst, B8.
"""

from __future__ import annotations

import atexit
from typing import Any

import ray

# Without the dashboard (about 0.7 s of Ray's start). A user who wants it, or Ray's state
# API, calls ray.init() before horovod_ray does. Workers at niceness 0, as horovodrun's
# ranks run, not Ray's default 15: a rank at 15 loses the CPU to anything else on the
# machine, Ray's own daemons included (docs/benchmarks.rst, "Rank priority").
OPTIONS: dict[str, Any] = {"include_dashboard": False, "_system_config": {"worker_niceness": 0}}


def start(**options: Any) -> None:
    """Starts a new local Ray instance (never joins one already on the machine), its
    workers at normal priority.

    Ray stops it when the interpreter exits, as for any ``ray.init()``; the autoscaler
    monitor is stopped first so that this stop is a second shorter. That exit hook is the
    process's: it also stops first the monitor of a local Ray started later by a plain
    ``ray.init()``, which is about to stop anyway.
    """
    ray.init(address="local", **{**OPTIONS, **options})
    # atexit runs hooks last registered first: this one before Ray's own shutdown (once,
    # however many times a local Ray is started).
    atexit.unregister(stop_monitor)
    atexit.register(stop_monitor)


def stop() -> None:
    """Stops the local Ray that ``start`` began."""
    stop_monitor()
    ray.shutdown()


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
