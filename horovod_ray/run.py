"""run(): the one-call way to run a function as a Horovod job on Ray."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import ray

from horovod_ray import config, local_ray
from horovod_ray.data.spec import data_spec
from horovod_ray.errors import ConfigError, named_as
from horovod_ray.failures import restarts
from horovod_ray.rank import calls
from horovod_ray.settings import (
    STALL_TIMEOUT_S,
    Settings,
    check_env,
    create_settings,
    require_settings,
)

logger = logging.getLogger(__name__)


def run(
    train_fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    num_hosts: int | None = None,
    num_slots: int | None = None,
    cpus_per_slot: float = 1,
    use_gpu: bool = False,
    timeout_s: float = 120,
    nics: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
    callbacks: Sequence[Callable[[dict], None]] | None = None,
    min_workers: int | None = None,
    max_workers: int | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float | None = None,
    # Last, so that the parameters before them keep their positions.
    cooldown_range: tuple[int, int] | None = None,
    discovery_interval_s: float | None = None,
    max_restarts: int = 0,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    niceness: int | None = None,
    placement_group_timeout_s: float = 100,
    storage_path: str | None = None,
    name: str | None = None,
    checkpoint_config: Any = None,
    storage_filesystem: Any = None,
    metrics: bool = True,
    report_values: bool = False,
    find_stragglers: bool = False,
    timeline: str | None = None,
    local: bool = False,
    validation_config: Any = None,
    datasets: Mapping[str, Any] | None = None,
    data_config: Any = None,
    scaling_config: Any = None,
    run_config: Any = None,
    settings: Settings | None = None,
) -> list[Any]:
    """Runs ``train_fn(*args, **kwargs)`` on ``num_hosts * num_slots`` Horovod ranks.

    Starts a job, runs the function on every rank, and stops the job whatever happens
    (success, a failed rank, Ctrl-C). If no Ray is running in this process, a local one is
    started (``ray.init(address="local", include_dashboard=False)``, or the cluster in
    ``RAY_ADDRESS`` when that is set, as in a Ray Job) and left running for later calls;
    to use a cluster, or to have Ray's dashboard, call ``ray.init(...)`` first.

    Args:
        train_fn: The training function; each rank calls ``hvd.init()`` inside it.
        args: Positional arguments for ``train_fn``.
        kwargs: Keyword arguments for ``train_fn``.
        num_hosts: Nodes to spread over (one placement bundle each, strictly spread);
            default 1.
        num_slots: Ranks per node; default 1.
        cpus_per_slot: CPUs each rank reserves.
        use_gpu: Reserve one GPU per rank.
        timeout_s: Seconds Gloo waits for peers before failing.
        nics: Network interfaces for Gloo in order of preference, e.g.
            ``["eth0", "ens5"]``: each node uses the first it has. None picks one.
        env: More environment variables (str to str) for every rank.
        callbacks: Called on the driver with each dict rank 0 passes to ``log()``; for an
            elastic job, a callback with an ``on_membership`` method (a
            ``horovod_ray.Callback``) also gets each change of membership there.
        min_workers: Makes the job elastic (see ``RayExecutor``): ``train_fn`` uses
            ``hvd.elastic.run`` and the world shrinks to no fewer than this many ranks.
            Leave ``num_hosts`` and ``num_slots`` unset then.
        max_workers: The most ranks an elastic job grows to.
        reset_limit: Elastic: fail after more than this many resets.
        elastic_timeout: Elastic: seconds the job may stay below ``min_workers`` (600).
        cooldown_range: Elastic: (low, high) seconds a failed node is kept out, growing
            between the two with each failure (None: a failed node stays out).
        discovery_interval_s: Elastic: how often Ray's node table is read for new room
            (default 1).
        max_restarts: Static jobs: after a failure (a rank raised or died, a node was
            lost), stop the job and run it again as a new one, up to this many times,
            waiting 1 s, then 2 s, 4 s, ... (at most 60 s) before each; with a
            ``storage_path``, ``get_checkpoint()`` inside ``train_fn`` gives the latest
            checkpoint to resume from, and ``attempt()`` says which attempt it is.
        stall_timeout_s: Seconds ranks may wait in a collective another rank never
            enters before the job fails with ``HangError`` (default 600; 0: off).
        niceness: The ranks' niceness, 0 (horovodrun's) to 19; None keeps Ray's (see
            ``create_settings``: lowering it needs CAP_SYS_NICE on the nodes).
        placement_group_timeout_s: Seconds to wait for Ray to place the ranks before
            failing with ``PlacementTimeoutError`` (default 100): raise it when the
            cluster must first grow (an autoscaler) or is busy.
        storage_path: Where rank 0's ``horovod_ray.report(metrics, checkpoint=...)``
            checkpoints persist: a local folder (shared by every node on a cluster) or a
            URI (``s3://bucket/runs``); None keeps none (see docs, "Checkpoints and
            resume"). Each attempt of ``max_restarts``, and a later call with the same
            ``storage_path`` and ``name``, starts from the latest one there
            (``horovod_ray.get_checkpoint()``).
        name: The job's name in its metrics and ``horovod-ray status``; with
            ``storage_path``, also the run's folder there (None makes one from the time,
            logged; give it again to resume), else None names it ``train_fn``'s. Read it
            back with
            ``horovod_ray.Result.from_path(f"{storage_path}/{name}")``.
        checkpoint_config: A ``ray.train.CheckpointConfig``: ``num_to_keep`` (the best
            by ``checkpoint_score_attribute`` and ``checkpoint_score_order``, and always
            the latest).
        storage_filesystem: A ``pyarrow.fs.FileSystem`` that ``storage_path`` is on.
        metrics: Export the job's and the ranks' metrics through Ray's metrics pipeline
            (docs/observability.rst).
        report_values: Each rank also exports the numbers it passes to ``report()``.
        find_stragglers: Also name the rank the others wait for (horovod's response
            cache then off, a cost: see ``Settings``).
        timeline: Write horovod's timeline (rank 0's Chrome trace) to this path on the
            driver when the job stops; with ``max_restarts``, the last attempt's.
        local: Run ``train_fn`` in this process as a job of one rank, without Ray, for a
            debugger (``pdb.set_trace()`` and breakpoints stop in it); ``report``,
            ``log``, ``get_checkpoint`` and ``get_context`` work as on a rank. Only with
            one rank (``num_hosts`` and ``num_slots`` 1 or unset) and no restarts.
            Validations then run in threads of this process, not as Ray tasks.
        validation_config: A ``ray.train.ValidationConfig(fn=...)``: the checkpoints
            reported with ``validation=True`` are validated by ``fn`` in Ray tasks, one at
            a time, and its metrics merged into theirs; ``run()`` returns once every one
            has ended (``checkpoints.validation``). Needs ``storage_path``.
        datasets: Ray Data for the ranks, as Ray Train's ``datasets=``: name ->
            ``ray.data.Dataset``, split over the ranks as the job starts (each rank the
            same number of rows per epoch); ``horovod_ray.get_dataset_shard(name)`` on a
            rank gives its part as a ``ray.data.DataIterator``. An elastic job (which
            needs ``max_workers`` then) splits in order, its position resumable
            (docs/data.rst).
        data_config: A ``ray.train.DataConfig``: which datasets are split (the others
            go whole to every rank), Ray Data's execution options; or a
            ``horovod_ray.DataConfig(resumable=True)``: split in order, each rank's
            position kept (``state_dict()``) for a restart to read on from.
        scaling_config: A ``ray.train.ScalingConfig``, instead of the sizing keywords
            (``num_hosts``, ``num_slots``, ``cpus_per_slot``, ``use_gpu``,
            ``min_workers``, ``max_workers``): ``num_workers=N`` ranks placed by its
            ``placement_strategy`` (PACK, STRICT_SPREAD or STRICT_PACK), or
            ``num_workers=(min, max)`` for an elastic job; ``resources_per_worker``'s
            CPU and GPU for each rank (docs/ray_train.rst).
        run_config: A ``ray.train.RunConfig`` (or Tune's), instead of ``name``,
            ``storage_path``, ``storage_filesystem`` and ``checkpoint_config``; its
            ``failure_config``'s ``max_failures`` is ``max_restarts``.
        settings: The job settings ``RayExecutor`` takes
            (``RayExecutor.create_settings(...)``), instead of the keywords they hold
            (``timeout_s``, ``nics``, ``stall_timeout_s``, ``niceness``,
            ``placement_group_timeout_s``, the storage ones, ``metrics``,
            ``report_values``, ``find_stragglers``, ``timeline``,
            ``validation_config``); None (its name too) names the job ``train_fn``'s.

    Returns:
        Each rank's return value, in world-rank order (an elastic job's final world).

    Raises:
        CheckpointError: The storage could not be read or written (an upload failed
            on rank 0: that is a rank's failure, a ``WorkerFailedError``).
        ConfigError: A bad argument, before Ray is touched; also an elastic argument
            (``reset_limit``, ``cooldown_range``, ``discovery_interval_s``) without
            ``min_workers`` (``elastic_timeout`` is taken and ignored, with a warning, as
            horovod.ray does).
        ElasticLimitError: An elastic job stayed below ``min_workers`` too long, or reset
            more than ``reset_limit`` times.
        PlacementTimeoutError: The cluster could not hold the job within
            ``placement_group_timeout_s``.
        WorkerFailedError: A rank raised or died (with ``max_restarts``, in every
            attempt; the text lists each attempt's cause); ``HangError``, a kind of it,
            when ranks waited on one that never joined their collective.
    """
    # Here, not at the top: a rank's process imports this module (see __init__).
    from horovod_ray.executor import RayExecutor

    wanted = config.from_ray(scaling_config, run_config)
    wanted.refuse_beside(
        {
            "num_hosts": num_hosts,
            "num_slots": num_slots,
            "cpus_per_slot": cpus_per_slot,
            "use_gpu": use_gpu,
            "min_workers": min_workers,
            "max_workers": max_workers,
            "discovery_interval_s": discovery_interval_s,
            "storage_path": storage_path,
            "name": name,
            "storage_filesystem": storage_filesystem,
            "checkpoint_config": checkpoint_config,
            "max_restarts": max_restarts,
        },
        _DEFAULTS,
    )
    max_restarts = wanted.run.get("max_restarts", max_restarts)
    job_settings = {
        "timeout_s": timeout_s,
        "placement_group_timeout_s": placement_group_timeout_s,
        "nics": nics,
        "stall_timeout_s": stall_timeout_s,
        "niceness": niceness,
        "storage_path": storage_path,
        "name": name,
        "checkpoint_config": checkpoint_config,
        "storage_filesystem": storage_filesystem,
        "metrics": metrics,
        "report_values": report_values,
        "find_stragglers": find_stragglers,
        "timeline": timeline,
        "validation_config": validation_config,
    }
    if settings is None:
        settings = create_settings(**job_settings)
    else:
        config.refuse("settings", job_settings, job_settings, _DEFAULTS)
        settings = require_settings(settings)
    settings = wanted.settings(settings)
    elastic = wanted.elastic or min_workers is not None or max_workers is not None
    restarts.RestartPolicy(max_restarts)  # checked first, whatever else is wrong
    _check_sizes(elastic, num_hosts, num_slots, max_restarts)
    if local is not False:
        if scaling_config is not None:
            raise ConfigError(
                "scaling_config", "local=True runs one rank in this process: drop scaling_config"
            )
        _check_local(local, elastic, num_hosts, num_slots, max_restarts)
        if not callable(train_fn):
            raise ConfigError("train_fn", f"train_fn must be callable, got {train_fn!r}")
        args, kwargs = calls.as_tuple("args", args), calls.as_kwargs("kwargs", kwargs)
        env = check_env(env, "env")
        from horovod_ray.rank.local import run_here

        data = data_spec(datasets, data_config)
        callbacks = calls.check_callbacks(callbacks)
        return run_here(train_fn, args, kwargs, settings, callbacks, env, data)

    if settings.name is None and getattr(train_fn, "__name__", None):
        # Named by its function in its metrics and ``horovod-ray status``.
        settings = dataclasses.replace(settings, name=train_fn.__name__)
    sizing = dict(wanted.sizing) or {
        "num_hosts": None if elastic else 1 if num_hosts is None else num_hosts,
        "num_workers_per_host": 1 if num_slots is None else num_slots,
        "cpus_per_worker": cpus_per_slot,
        "use_gpu": use_gpu,
        "min_workers": min_workers,
        "max_workers": max_workers,
    }
    discovery_interval_s = sizing.pop("discovery_interval_s", discovery_interval_s)
    with named_as(_RUN_NAMES):
        job = RayExecutor(  # checks the job's arguments
            settings,
            **sizing,
            reset_limit=reset_limit,
            cooldown_range=cooldown_range,
            elastic_timeout=elastic_timeout,
            discovery_interval_s=discovery_interval_s,
            datasets=datasets,
            data_config=data_config,
            max_restarts=max_restarts,
        )
        # Everything the executor would check later is checked now, before Ray starts,
        # and the function and its arguments are pickled once, here.
        call = calls.prepare(train_fn, args, kwargs, fn_name="train_fn")
        env = check_env(env, "env")
    callbacks = calls.check_callbacks(callbacks)
    bounds, layout = job.elastic, job.layout
    if bounds is not None:
        ranks = bounds.max_workers or bounds.min_workers
    else:  # run() gives a count or hosts, never a host list
        ranks = layout.num_workers or layout.num_hosts * layout.num_workers_per_host
    _ensure_ray(num_cpus=math.ceil(ranks * layout.cpus_per_worker))
    # One job, whatever its restarts (the executor's: ``failures/restarts``).
    try:
        job.start(extra_env_vars=env)
        return job._run_call(call, callbacks)
    finally:
        job.stop()


# run()'s keywords as it defaults them: a config object beside one given refuses it.
_DEFAULTS = {
    name: parameter.default for name, parameter in inspect.signature(run).parameters.items()
}
# RayExecutor's parameters under the names run() gives them.
_RUN_NAMES = {
    "num_workers_per_host": "num_slots",
    "cpus_per_worker": "cpus_per_slot",
}


def _check_local(
    local: object, elastic: bool, num_hosts: object, num_slots: object, max_restarts: object
) -> None:
    """``local=True`` runs one rank here: anything that asks for more is refused."""
    if local is not True:
        raise ConfigError("local", f"local must be True or False, got {local!r}")
    for name, value in (("num_hosts", num_hosts), ("num_slots", num_slots)):
        if value not in (None, 1):
            raise ConfigError(
                name, f"local=True runs one rank in this process: leave {name} unset (or 1)"
            )
    if elastic:
        raise ConfigError("min_workers", "local=True runs one rank: an elastic job needs Ray")
    if max_restarts:
        raise ConfigError(
            "max_restarts", "local=True runs once, in this process: drop max_restarts"
        )


def _check_sizes(
    elastic: bool, num_hosts: int | None, num_slots: int | None, max_restarts: object
) -> None:
    if not elastic:
        return
    for name, value in (("num_hosts", num_hosts), ("num_slots", num_slots)):
        if value is not None:
            raise ConfigError(
                name, f"an elastic job (min_workers/max_workers) sizes itself: leave {name} unset"
            )
    if max_restarts:
        raise ConfigError(
            "max_restarts",
            "an elastic job recovers in place (its survivors reset): max_restarts is for "
            "static jobs; drop it, or give num_hosts/num_slots instead of min_workers",
        )


def _ensure_ray(num_cpus: int) -> None:
    """Joins RAY_ADDRESS, or starts a local Ray with room for ``num_cpus`` CPUs (at least
    the machine's), when this process has none."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        # A Ray Job's driver, or a user's choice: join that cluster.
        logger.info("no Ray running in this process: joining RAY_ADDRESS")
        local_ray.join()
    else:
        # A new local instance, never another one that happens to run on the machine.
        logger.info("no Ray running in this process: starting a local one")
        local_ray.start(num_cpus=max(os.cpu_count() or 1, num_cpus))
