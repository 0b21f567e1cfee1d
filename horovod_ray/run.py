"""run(): the one-call way to run a function as a Horovod job on Ray."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Sequence

import ray

from horovod_ray.executor import (
    RayExecutor,
    _as_kwargs,
    _as_tuple,
    _check_callbacks,
    _check_env,
    _pickle_args,
    _pickle_fn,
)
from horovod_ray.settings import create_settings

logger = logging.getLogger(__name__)


def run(
    train_fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    num_hosts: int = 1,
    num_slots: int = 1,
    cpus_per_slot: float = 1,
    use_gpu: bool = False,
    timeout_s: float = 120,
    nics: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
    callbacks: Sequence[Callable[[dict], None]] | None = None,
) -> list[Any]:
    """Runs ``train_fn(*args, **kwargs)`` on ``num_hosts * num_slots`` Horovod ranks.

    Starts a job, runs the function on every rank, and stops the job whatever happens
    (success, a failed rank, Ctrl-C). If no Ray is running in this process, a local one is
    started with ``ray.init()`` and left running for later calls; to use a cluster, call
    ``ray.init(address=...)`` first.

    Args:
        train_fn: The training function; each rank calls ``hvd.init()`` inside it.
        args: Positional arguments for ``train_fn``.
        kwargs: Keyword arguments for ``train_fn``.
        num_hosts: Nodes to spread over (one placement bundle each, strictly spread).
        num_slots: Ranks per node.
        cpus_per_slot: CPUs each rank reserves.
        use_gpu: Reserve one GPU per rank.
        timeout_s: Seconds Gloo waits for peers before failing.
        nics: Network interfaces for Gloo, e.g. ``["eth0"]``; None picks one.
        env: More environment variables (str to str) for every rank.
        callbacks: Called on the driver with each dict rank 0 passes to ``log()``.

    Returns:
        Each rank's return value, in world-rank order.

    Raises:
        ConfigError: A bad argument, before Ray is touched.
        PlacementTimeoutError: The cluster cannot hold the job.
        WorkerFailedError: A rank raised or died.
    """
    settings = create_settings(timeout_s=timeout_s, nics=nics)
    executor = RayExecutor(
        settings,
        num_hosts=num_hosts,
        num_workers_per_host=num_slots,
        cpus_per_worker=cpus_per_slot,
        use_gpu=use_gpu,
    )
    # Everything the executor would check later is checked now, before Ray starts.
    _pickle_fn("train_fn", train_fn)
    _pickle_args(_as_tuple("args", args), _as_kwargs("kwargs", kwargs))
    _check_env(env)
    _check_callbacks(callbacks)
    if not ray.is_initialized():
        logger.info("no Ray running in this process: starting a local one with ray.init()")
        ray.init()
    try:
        executor.start(extra_env_vars=env)
        return executor.run(train_fn, args=args, kwargs=kwargs, callbacks=callbacks)
    finally:
        executor.stop()
