"""``DistributedTrainableCreator``: a Tune Trainable whose every trial is a Horovod job.

How a trial runs:

* The trial reserves one bundle per host (``num_slots * num_cpus_per_slot`` CPUs, plus
  GPUs; a HorovodTrainer's ``num_workers`` packed: one per rank) and an empty head
  bundle, so the trial's own actor takes nothing; the trial's RayExecutor places its
  ranks inside that group.
* Its ranks run the function under a Tune session of their own (``session``).
* The job is stopped when the trial fails, is stopped by a scheduler or paused, and when
  Tune stops the trial's actor; then its ranks' copies of the restored checkpoint are
  removed (a rank killed mid-trial cannot remove its own). A trial that finishes leaves
  its job running, idle, for the next trial on the same actor: with
  ``TuneConfig(reuse_actors=True)`` Tune hands a finished trial's actor (and its placement
  group) to the next trial, whose ranks then have the framework imported and Horovod
  joined already. ``hvd.init()`` on a rank that is still initialised does nothing; after
  ``hvd.shutdown()`` it joins again. A warm job is checked with one no-op call before a
  trial uses it, and replaced if that fails. A trial with ``datasets=`` leaves none: its
  split ends with it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
import uuid
from typing import Any, Callable, Mapping

import ray
from ray import tune

from horovod_ray.data.spec import DataSpec, check_rows, data_spec
from horovod_ray.errors import ConfigError, HorovodRayError
from horovod_ray.executor import ExecutorState, RayExecutor
from horovod_ray.job.layouts import WorkerLayout
from horovod_ray.job.lifecycle import FINAL
from horovod_ray.rank.calls import pickle_fn
from horovod_ray.settings import Settings, create_settings, require_positive, require_settings
from horovod_ray.tune.parcels import pack_checkpoint
from horovod_ray.tune.session import (
    TrialFacts,
    forward,
    rank_main,
    remove_forwarded_copies,
    remove_restored_copies,
    sweep_stale,
    wrap_function,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _TrialSpec:
    func: Callable[[dict], Any]
    settings: Settings
    layout: WorkerLayout
    data: DataSpec | None = None


class _Job:
    """A trial's Horovod job, and where its ranks may have left restored copies."""

    def __init__(self, executor: RayExecutor) -> None:
        self.executor = executor
        # Names this job's ranks' restored copies (see session.remove_restored_copies).
        self.copies_tag = uuid.uuid4().hex[:12]
        self.node_ids: frozenset[str] = frozenset()  # set once the job has started
        self._lock = threading.Lock()
        self._removed = False

    def started(self) -> None:
        self.node_ids = frozenset(rank.node_id for rank in self.executor.ranks)

    def stop(self) -> None:
        """Stops the job, then removes its ranks' restored copies, once (cleanup() and
        the trial's thread may both stop it); a job not released yet (its stop timed
        out) keeps them, for ``sweep_stale`` to take once its ranks are gone."""
        self.executor.stop()
        with self._lock:
            if self.executor.state not in FINAL or self._removed:
                return
            self._removed = True
        remove_restored_copies(self.copies_tag, self.node_ids)


class _TrialJobs:
    """The Horovod jobs of the trials on this actor (one process, one trial at a time).

    ``active``: the running trial's job, so that cleanup() can stop it while the trial's
    thread still waits on its ranks. ``warm``: the idle job a finished trial left for the
    next trial on this actor, with the spec it was made for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[_Job] = set()
        self._warm: tuple[_TrialSpec, _Job] | None = None

    def stop_all(self) -> None:
        """Stops the running trial's job, if any, and the warm one."""
        with self._lock:
            jobs = list(self._active)
            if self._warm is not None:
                jobs.append(self._warm[1])
                self._warm = None
        for job in jobs:
            job.stop()

    def take_warm(self, spec: _TrialSpec) -> _Job | None:
        """The job a finished trial left, if it fits ``spec`` and still works; active."""
        with self._lock:
            warm, self._warm = self._warm, None
            if warm is None:
                return None
            warm_spec, job = warm
            self._active.add(job)  # cleanup() must find it while it is being checked
        current = ray.util.get_current_placement_group()
        try:
            # placement_group raises when the job is no longer running.
            same_group = current is not None and job.executor.placement_group.id == current.id
            if warm_spec == spec and same_group:
                job.executor.run(os.getpid)  # a rank that died while idle fails this, not the trial
                return job
        except HorovodRayError:
            logger.info("the last trial's warm Horovod job failed or stopped; starting a new one")
        self.finish(spec, job, keep=False)
        return None

    def begin(self, job: _Job) -> None:
        with self._lock:
            self._active.add(job)

    def finish(self, spec: _TrialSpec, job: _Job, keep: bool) -> None:
        """Ends a trial's use of ``job``: kept warm if ``keep`` and still running."""
        with self._lock:
            self._active.discard(job)
            # A job with datasets is not kept: its split and Ray Data's reservation end
            # with the trial (and each trial's spec, datasets and all, arrives unpickled:
            # no two compare equal anyway).
            keep = keep and job.executor.state is ExecutorState.RUNNING and spec.data is None
            if keep:
                self._warm = (spec, job)
        if not keep:
            job.stop()


_jobs = _TrialJobs()


def _stop_all() -> None:
    # Module-level, so that the trainable class (pickled by value) refers to it by name
    # and never tries to pickle the process's _TrialJobs with its lock.
    _jobs.stop_all()


def _run_trial(config: dict, spec: _TrialSpec) -> None:
    """Runs on the trial's actor: the trial's Horovod job, warm from the last trial or new."""
    sweep_stale()  # a killed trial actor's copy on its way to Tune, if any
    checkpoint = pack_checkpoint(tune.get_checkpoint())
    trial = TrialFacts.of_this_trial()
    job = _jobs.take_warm(spec)
    fresh = job is None
    if fresh:
        # Inside the trial's placement group: the ranks take its bundles.
        layout = spec.layout
        job = _Job(
            RayExecutor(
                spec.settings,
                num_workers=layout.num_workers,
                num_hosts=layout.num_hosts,
                num_workers_per_host=layout.num_workers_per_host,
                cpus_per_worker=layout.cpus_per_worker,
                use_gpu=layout.use_gpu,
                gpus_per_worker=layout.gpus_per_worker,
                datasets=None if spec.data is None else spec.data.datasets,
                data_config=None if spec.data is None else spec.data.config,
            )
        )
    _jobs.begin(job)
    finished = False
    try:
        if fresh:
            job.executor.start()
            job.started()
        job.executor.run(
            rank_main,
            args=[spec.func, config, checkpoint, trial, job.copies_tag],
            callbacks=[forward],
        )
        finished = True
    finally:
        _jobs.finish(spec, job, keep=finished)


def _check_signature(func: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as err:
        raise ConfigError("func", f"cannot read the signature of func: {err}") from err
    try:
        signature.bind({})
    except TypeError as err:
        raise ConfigError(
            "func",
            f"func must take exactly one argument, the trial's config (def train(config): "
            f"...), got {func.__name__}{signature}",
        ) from err


def trial_settings(settings: object, timeout_s: float | None, name: str | None) -> Settings:
    """The settings of every trial's job, checked; named by the function (each trial's
    job shows under it in its metrics and ``horovod-ray status``) unless they name it."""
    if settings is None:
        return create_settings(timeout_s=120 if timeout_s is None else timeout_s, name=name)
    settings = require_settings(settings)
    if timeout_s is not None:
        raise ConfigError(
            "timeout_s",
            "timeout_s is given here and settings are too: give it in "
            "RayExecutor.create_settings(timeout_s=...) alone",
        )
    if settings.storage is not None or settings.validation is not None:
        raise ConfigError(
            "settings",
            "settings hold a storage_path (or validation_config): a trial's checkpoints are "
            "Tune's; give tune.RunConfig(storage_path=...) to the Tuner instead",
        )
    if settings.timeline is not None:
        raise ConfigError(
            "settings",
            "settings hold a timeline: every trial's job would write the same file; set "
            "HOROVOD_TIMELINE on the ranks for one per rank 0's node instead",
        )
    return settings if settings.name else dataclasses.replace(settings, name=name)


def DistributedTrainableCreator(  # noqa: N802 - the name users know from horovod.ray.tune
    func: Callable[[dict], Any],
    num_hosts: int = 1,
    num_slots: int = 1,
    num_cpus_per_slot: float = 1,
    use_gpu: bool = False,
    timeout_s: float | None = None,
    *,
    settings: Settings | None = None,
    datasets: Mapping[str, Any] | None = None,
    data_config: Any = None,
) -> type[tune.Trainable]:
    """Makes a Tune Trainable whose every trial runs ``func`` as a Horovod job.

    Args:
        func: A Tune function, ``func(config)``, that calls ``hvd.init()``, reports with
            ``ray.tune.report(metrics, checkpoint=...)`` and resumes from
            ``ray.tune.get_checkpoint()``. Rank 0's reports are the trial's results.
        num_hosts: Nodes per trial (one placement bundle each; strictly spread when > 1).
        num_slots: Ranks per node.
        num_cpus_per_slot: CPUs each rank reserves.
        use_gpu: Reserve one GPU per rank.
        timeout_s: Seconds Gloo waits for peers before failing (None: 120, or the
            ``settings``' own).
        settings: The job settings ``run()`` and ``RayExecutor`` take, from
            ``RayExecutor.create_settings(...)``, for every trial's job: ``nics``,
            ``stall_timeout_s``, ``niceness``, ``placement_group_timeout_s``, ``verbose``,
            ``metrics``, ``report_values``, ``find_stragglers``, ``name`` (None: the
            function's). Not ``storage_path`` nor ``validation_config`` (a trial's
            checkpoints are Tune's: ``tune.RunConfig(storage_path=...)``), nor
            ``timeline`` (every trial would write the same file).
        datasets: Ray Data for each trial's ranks (as ``run()``'s): name ->
            ``ray.data.Dataset``, split afresh over every trial's ranks;
            ``horovod_ray.get_dataset_shard(name)`` in ``func`` gives a rank its part.
        data_config: A ``ray.train.DataConfig`` for ``datasets``.

    Returns:
        A ``tune.Trainable`` subclass for ``tune.Tuner`` (or ``tune.run``).

    Raises:
        ConfigError: A bad argument; raised here, not inside a trial.
    """
    if not callable(func):
        raise ConfigError("func", f"func must be a function taking config, got {func!r}")
    _check_signature(func)
    require_positive("num_hosts", num_hosts, integer=True)
    require_positive("num_slots", num_slots, integer=True)
    require_positive("num_cpus_per_slot", num_cpus_per_slot)
    if not isinstance(use_gpu, bool):
        raise ConfigError("use_gpu", f"use_gpu must be True or False, got {use_gpu!r}")
    settings = trial_settings(settings, timeout_s, getattr(func, "__name__", None) or None)
    sizing = {"num_hosts": num_hosts, "num_workers_per_host": num_slots}
    sizing |= {"cpus_per_worker": num_cpus_per_slot, "use_gpu": use_gpu}
    pickle_fn("func", func)
    name = getattr(func, "__name__", "func")
    return trial_trainable(func, sizing, settings, datasets, data_config, f"Horovod_{name}", name)


def trial_trainable(
    func: Callable[[dict], Any],
    sizing: Mapping[str, Any],
    settings: Settings,
    datasets: Mapping[str, Any] | None,
    data_config: Any,
    trial_name: str,
    class_suffix: str,
) -> type[tune.Trainable]:
    """The Trainable class whose every trial runs ``func(config)`` on the ranks of a job
    sized by ``sizing`` (RayExecutor's keywords: ``num_workers`` packed, or ``num_hosts``
    of ``num_workers_per_host``; each rank's resources), inside the trial's placement
    group, with ``datasets`` split over its ranks; Tune names its trials after
    ``trial_name``. ``func`` and ``settings`` are checked already
    (DistributedTrainableCreator, HorovodTrainer.as_trainable).

    Raises:
        ConfigError: A bad size or datasets, named.
    """
    layout = WorkerLayout(**sizing)
    data = data_spec(datasets, data_config)
    if data is not None:
        check_rows(data, layout.num_workers or layout.num_hosts * layout.num_workers_per_host)
    per_worker = layout.worker_resources()
    if layout.num_workers is not None:
        bundles = [dict(per_worker) for _ in range(layout.num_workers)]
        strategy = "PACK"
    else:
        slots = layout.num_workers_per_host
        per_host = {resource: amount * slots for resource, amount in per_worker.items()}
        bundles = [dict(per_host) for _ in range(layout.num_hosts)]
        strategy = "STRICT_SPREAD" if layout.num_hosts > 1 else "PACK"
    # An empty head bundle: the trial's own actor takes nothing.
    resources = tune.PlacementGroupFactory([{}] + bundles, strategy=strategy)

    spec = _TrialSpec(func, settings, layout, data)

    def run_trial(config: dict) -> None:
        # Only module-level names in here: Tune pickles this closure by value.
        _run_trial(config, spec)

    base = wrap_function(run_trial, name=trial_name)

    class DistributedTrainable(base):  # type: ignore[misc, valid-type]
        """A Tune trial running ``func`` on a Horovod job (see DistributedTrainableCreator)."""

        @classmethod
        def default_resource_request(cls, config: dict) -> tune.PlacementGroupFactory:
            return resources

        def cleanup(self) -> None:
            _stop_all()
            try:
                super().cleanup()
            finally:
                # The trial's thread may have been stopped inside forward's report.
                remove_forwarded_copies()

    DistributedTrainable.__name__ = f"DistributedTrainable_{class_suffix}"
    DistributedTrainable.__qualname__ = DistributedTrainable.__name__
    return DistributedTrainable
