"""Ray Tune adapter: every trial is a distributed Horovod job.

``DistributedTrainableCreator(train, num_hosts, num_slots)`` turns an ordinary Tune
function (one that calls ``ray.tune.report`` and ``ray.tune.get_checkpoint``) into a
Trainable whose trials each run ``train`` on ``num_hosts * num_slots`` Horovod ranks.

How a trial runs:

* The trial reserves one bundle per host (``num_slots * num_cpus_per_slot`` CPUs, plus
  GPUs) and an empty head bundle, so the trial's own actor takes nothing; the trial's
  RayExecutor places its ranks inside that group.
* On every rank, ``ray.tune.report`` and ``ray.tune.get_checkpoint`` are served by a small
  per-process session: rank 0's reports (metrics, and the checkpoint directory packed into
  bytes) go to the trial's actor, which reports them to Tune; other ranks' reports are
  accepted and dropped. The restored checkpoint is unpacked on every rank.
* The job is stopped when the trial fails, is stopped by a scheduler or paused, and when
  Tune stops the trial's actor. A trial that finishes leaves its job running, idle, for
  the next trial on the same actor: with ``TuneConfig(reuse_actors=True)`` Tune hands a
  finished trial's actor (and its placement group) to the next trial, whose ranks then
  have the framework imported and Horovod joined already. ``hvd.init()`` on a rank that
  is still initialised does nothing; after ``hvd.shutdown()`` it joins again. A warm job
  is checked with one no-op call before a trial uses it, and replaced if that fails.

Checkpoints travel through Ray's object store, so they suit model states of up to a few
hundred MB.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import logging
import os
import shutil
import tarfile
import tempfile
import threading
from types import ModuleType
from typing import Any, Callable

import ray
from ray import tune

from horovod_ray.calls import pickle_fn
from horovod_ray.errors import ConfigError, HorovodRayError
from horovod_ray.executor import ExecutorState, RayExecutor
from horovod_ray.layouts import WorkerLayout
from horovod_ray.logs import post
from horovod_ray.settings import Settings, create_settings, require_positive

logger = logging.getLogger(__name__)

__all__ = ["DistributedTrainableCreator"]

# The Ray whose internals this adapter uses (constraints.txt pins it).
_SUPPORTED_RAY = "2.60"


def _ray_internals() -> tuple[ModuleType, Callable[..., Any]]:
    """The two Ray internals this adapter needs, checked once, at import.

    ``ray.train._internal.session._session`` is the process-wide session that
    ``ray.tune.report`` and ``ray.tune.get_checkpoint`` read (the ranks install their own
    there), and ``ray.tune.trainable.function_trainable.wrap_function(fn, name=...)`` makes
    the trainable class. Neither is public API: a Ray that moved them would otherwise fail
    with an ImportError deep in Ray, or send the ranks' reports nowhere.

    Raises:
        HorovodRayError: Naming the Ray found, the one supported and what is missing.
    """

    def unsupported(missing: str) -> HorovodRayError:
        return HorovodRayError(
            f"horovod_ray.tune supports Ray {_SUPPORTED_RAY} and found Ray {ray.__version__}, "
            f"which lacks {missing}; install ray[tune]=={_SUPPORTED_RAY}.0 (see constraints.txt)"
        )

    try:
        from ray.train._internal import session
    except ImportError as err:
        raise unsupported("ray.train._internal.session") from err
    try:
        from ray.tune.trainable.function_trainable import wrap_function
    except ImportError as err:
        raise unsupported("ray.tune.trainable.function_trainable.wrap_function") from err
    if not hasattr(session, "_session"):
        raise unsupported("ray.train._internal.session._session")
    if "name" not in inspect.signature(wrap_function).parameters:
        raise unsupported("the name parameter of wrap_function")
    return session, wrap_function


train_session, wrap_function = _ray_internals()


@dataclasses.dataclass(frozen=True)
class _Report:
    """One ``ray.tune.report`` from rank 0, on its way to the trial's actor."""

    metrics: dict
    checkpoint: bytes | None


def _pack(directory: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(directory, arcname=".")
    return buffer.getvalue()


def _unpack(data: bytes, directory: str) -> str:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
        archive.extractall(directory, filter="data")
    return directory


def _pack_checkpoint(checkpoint: tune.Checkpoint | None) -> bytes | None:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return _pack(directory)


class _RankSession:
    """What ``ray.tune.report`` / ``get_checkpoint`` find on a rank of a trial's job.

    Ray's Tune functions look up a process-wide session object; on the trial's actor that
    is Tune's own, on the ranks it is this one.
    """

    # Tune's functions read world_rank None as "a Tune session, not a Train one".
    world_rank = None

    def __init__(self, rank: int, checkpoint: bytes | None, trial_info: dict) -> None:
        self._rank = rank
        self._checkpoint_bytes = checkpoint
        self._checkpoint_dir: str | None = None
        self.trial_name = trial_info.get("trial_name")
        self.trial_id = trial_info.get("trial_id")
        self.trial_resources = trial_info.get("trial_resources")
        self.experiment_name = trial_info.get("experiment_name")

    @property
    def loaded_checkpoint(self) -> tune.Checkpoint | None:
        if self._checkpoint_bytes is None:
            return None
        if self._checkpoint_dir is None:
            directory = tempfile.mkdtemp(prefix="horovod_ray-restored-")
            self._checkpoint_dir = _unpack(self._checkpoint_bytes, directory)
        return tune.Checkpoint.from_directory(self._checkpoint_dir)

    def report(self, metrics: dict, *, checkpoint: tune.Checkpoint | None = None) -> None:
        if self._rank != 0:
            return
        # Packed now: the caller may delete the directory as soon as report returns.
        post(_Report(dict(metrics), _pack_checkpoint(checkpoint)))

    def close(self) -> None:
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)


def _install_session(session: _RankSession | None) -> None:
    """Makes ``session`` the process-wide session Tune's functions read.

    ``ray.tune.report`` and ``ray.tune.get_checkpoint`` look up
    ``ray.train._internal.session._session`` (Ray 2.60); ``_ray_internals`` checked at
    import that it is there, and test_tune checks that Tune reads it.
    """
    train_session._session = session


def _rank_main(func: Callable[[dict], Any], config: dict, checkpoint, trial_info: dict) -> None:
    session = _RankSession(int(os.environ["HOROVOD_RANK"]), checkpoint, trial_info)
    _install_session(session)
    try:
        func(config)
    finally:
        _install_session(None)
        session.close()


def _forward(item: object) -> None:
    """Runs on the trial's actor: hands one of rank 0's reports to Tune."""
    if not isinstance(item, _Report):
        return  # horovod_ray.log() dicts have no meaning to Tune
    if item.checkpoint is None:
        tune.report(item.metrics)
        return
    directory = tempfile.mkdtemp(prefix="horovod_ray-checkpoint-")
    try:
        _unpack(item.checkpoint, directory)
        # Tune persists the checkpoint to the trial's storage before report returns.
        tune.report(item.metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _TrialSpec:
    func: Callable[[dict], Any]
    settings: Settings
    num_hosts: int
    num_slots: int
    num_cpus_per_slot: float
    use_gpu: bool


class _TrialJobs:
    """The Horovod jobs of the trials on this actor (one process, one trial at a time).

    ``active``: the running trial's job, so that cleanup() can stop it while the trial's
    thread still waits on its ranks. ``warm``: the idle job a finished trial left for the
    next trial on this actor, with the spec it was made for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[RayExecutor] = set()
        self._warm: tuple[_TrialSpec, RayExecutor] | None = None

    def stop_all(self) -> None:
        """Stops the running trial's job, if any, and the warm one."""
        with self._lock:
            executors = list(self._active)
            if self._warm is not None:
                executors.append(self._warm[1])
                self._warm = None
        for executor in executors:
            executor.stop()

    def take_warm(self, spec: _TrialSpec) -> RayExecutor | None:
        """The job a finished trial left, if it fits ``spec`` and still works; active."""
        with self._lock:
            warm, self._warm = self._warm, None
            if warm is None:
                return None
            warm_spec, executor = warm
            self._active.add(executor)  # cleanup() must find it while it is being checked
        current = ray.util.get_current_placement_group()
        try:
            # placement_group raises when the job is no longer running.
            same_group = current is not None and executor.placement_group.id == current.id
            if warm_spec == spec and same_group:
                executor.run(os.getpid)  # a rank that died while idle fails this, not the trial
                return executor
        except HorovodRayError:
            logger.info("the last trial's warm Horovod job failed or stopped; starting a new one")
        self.finish(spec, executor, keep=False)
        return None

    def begin(self, executor: RayExecutor) -> None:
        with self._lock:
            self._active.add(executor)

    def finish(self, spec: _TrialSpec, executor: RayExecutor, keep: bool) -> None:
        """Ends a trial's use of ``executor``: kept warm if ``keep`` and still running."""
        with self._lock:
            self._active.discard(executor)
            keep = keep and executor.state is ExecutorState.RUNNING
            if keep:
                self._warm = (spec, executor)
        if not keep:
            executor.stop()


_jobs = _TrialJobs()


def _stop_all() -> None:
    # Module-level, so that the trainable class (pickled by value) refers to it by name
    # and never tries to pickle the process's _TrialJobs with its lock.
    _jobs.stop_all()


def _run_trial(config: dict, spec: _TrialSpec) -> None:
    """Runs on the trial's actor: the trial's Horovod job, warm from the last trial or new."""
    checkpoint = _pack_checkpoint(tune.get_checkpoint())
    context = tune.get_context()
    trial_info = {
        "trial_name": context.get_trial_name(),
        "trial_id": context.get_trial_id(),
        "trial_resources": context.get_trial_resources(),
        "experiment_name": context.get_experiment_name(),
    }
    executor = _jobs.take_warm(spec)
    fresh = executor is None
    if fresh:
        # Inside the trial's placement group: the ranks take its bundles.
        executor = RayExecutor(
            spec.settings,
            num_hosts=spec.num_hosts,
            num_workers_per_host=spec.num_slots,
            cpus_per_worker=spec.num_cpus_per_slot,
            use_gpu=spec.use_gpu,
        )
    _jobs.begin(executor)
    finished = False
    try:
        if fresh:
            executor.start()
        executor.run(
            _rank_main, args=[spec.func, config, checkpoint, trial_info], callbacks=[_forward]
        )
        finished = True
    finally:
        _jobs.finish(spec, executor, keep=finished)


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


def DistributedTrainableCreator(  # noqa: N802 - the name users know from horovod.ray.tune
    func: Callable[[dict], Any],
    num_hosts: int = 1,
    num_slots: int = 1,
    num_cpus_per_slot: float = 1,
    use_gpu: bool = False,
    timeout_s: float = 120,
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
        timeout_s: Seconds Gloo waits for peers before failing.

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
    settings = create_settings(timeout_s=timeout_s)
    layout = WorkerLayout(
        num_hosts=num_hosts,
        num_workers_per_host=num_slots,
        cpus_per_worker=num_cpus_per_slot,
        use_gpu=use_gpu,
    )
    pickle_fn("func", func)

    per_host = {name: amount * num_slots for name, amount in layout.worker_resources().items()}
    resources = tune.PlacementGroupFactory(
        [{}] + [dict(per_host) for _ in range(num_hosts)],
        strategy="STRICT_SPREAD" if num_hosts > 1 else "PACK",
    )

    spec = _TrialSpec(func, settings, num_hosts, num_slots, num_cpus_per_slot, use_gpu)

    def run_trial(config: dict) -> None:
        # Only module-level names in here: Tune pickles this closure by value.
        _run_trial(config, spec)

    name = getattr(func, "__name__", "func")
    base = wrap_function(run_trial, name=f"Horovod_{name}")

    class DistributedTrainable(base):  # type: ignore[misc, valid-type]
        """A Tune trial running ``func`` on a Horovod job (see DistributedTrainableCreator)."""

        @classmethod
        def default_resource_request(cls, config: dict) -> tune.PlacementGroupFactory:
            return resources

        def cleanup(self) -> None:
            _stop_all()
            super().cleanup()

    DistributedTrainable.__name__ = f"DistributedTrainable_{name}"
    DistributedTrainable.__qualname__ = DistributedTrainable.__name__
    return DistributedTrainable
