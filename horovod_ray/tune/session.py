"""A trial's ranks as Tune sees them: both halves of ``ray.tune.report`` /
``get_checkpoint`` on a Horovod job.

On every rank, Tune's functions are served by a small per-process session
(:class:`TrialSession`): rank 0's reports (metrics, and the checkpoint directory packed
into bytes) go to the trial's actor, whose :func:`forward` reports them to Tune, and
each returns once Tune has taken it, as Ray's own ``tune.report`` does; other ranks'
reports are accepted and dropped. The restored checkpoint is unpacked on every rank, and
``ray.tune.get_context()`` answers with the trial's facts (:class:`TrialFacts`).

Checkpoints travel as tar archives (``parcels``): rank 0's reported ones as a file on its
node, the restored one through Ray's object store; they suit model states of up to a few
hundred MB. Links in a checkpoint's folder are followed: what they point to travels.
The copies made on the way are removed when they are no longer read, also when the
trial is stopped with its ranks mid-training (:func:`remove_restored_copies`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import shutil
import tempfile
from types import ModuleType
from typing import Any, Callable, Iterable

import ray
from ray import tune
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.checkpoints import leftovers
from horovod_ray.errors import HorovodRayError
from horovod_ray.rank import report
from horovod_ray.rank.logs import post_and_wait_delivered
from horovod_ray.tune import parcels

logger = logging.getLogger(__name__)

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


# The folders checkpoint copies are made in, followed by the process id, ``-`` and a
# suffix (a restored copy's suffix starts with its job's tag and ``-``).
RESTORED_PREFIX = "horovod_ray-restored-"
FORWARDED_PREFIX = "horovod_ray-checkpoint-"
# How long removing a stopped job's restored copies waits for its other nodes.
REMOVE_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Report:
    """One ``ray.tune.report`` from rank 0, on its way to the trial's actor."""

    metrics: dict
    checkpoint: parcels.Parcel | None


@dataclasses.dataclass(frozen=True)
class TrialFacts:
    """What the trial's own Tune session says about the trial, for its ranks' sessions:
    the attributes of Ray 2.60's ``_TrainSession`` that ``ray.tune.get_context()``'s
    methods read (``get_trial_dir``, ``get_storage``, ...).

    ``storage`` is a copy taken when the trial's ranks started: its paths are the
    trial's, and paths on the trial's node (``trial_dir`` too), as the actor sees them.
    """

    trial_name: str | None = None
    trial_id: str | None = None
    trial_resources: Any = None
    experiment_name: str | None = None
    trial_dir: str | None = None
    run_id: str | None = None
    storage: Any = None

    @classmethod
    def of_this_trial(cls) -> TrialFacts:
        """The facts of the trial this process (a trial's actor) runs now."""
        session = train_session.get_session()
        return cls(
            trial_name=session.trial_name,
            trial_id=session.trial_id,
            trial_resources=session.trial_resources,
            experiment_name=session.experiment_name,
            trial_dir=session.trial_dir,
            run_id=session.run_id,
            storage=session.storage,
        )


class TrialSession:
    """What ``ray.tune.report`` / ``get_checkpoint`` / ``get_context`` find on a rank of a
    trial's job.

    Ray's Tune functions look up a process-wide session object; on the trial's actor that
    is Tune's own, on the ranks it is this one, with the trial's facts.

    Args:
        rank: This rank's world rank: only rank 0's reports go to Tune.
        checkpoint: The trial's restored checkpoint, packed; None when it has none.
        trial: The trial's facts, as its actor's session has them.
        copies_tag: Names the restored copy's folder, so that the trial's actor can
            remove it once the job is stopped (see :func:`remove_restored_copies`).
    """

    # Tune's functions read world_rank None as "a Tune session, not a Train one"; the
    # other rank facts are None in a Tune session too (Tune deprecates them: use hvd's).
    world_rank = None
    local_rank = None
    node_rank = None
    local_world_size = None
    world_size = None
    metadata = None

    def __init__(
        self, rank: int, checkpoint: bytes | None, trial: TrialFacts, copies_tag: str = ""
    ) -> None:
        self._rank = rank
        self._checkpoint_bytes = checkpoint
        self._checkpoint_dir: str | None = None
        self._copies_tag = copies_tag
        self.trial_name = trial.trial_name
        self.trial_id = trial.trial_id
        self.trial_resources = trial.trial_resources
        self.experiment_name = trial.experiment_name
        self.trial_dir = trial.trial_dir
        self.run_id = trial.run_id
        self.storage = trial.storage

    @property
    def loaded_checkpoint(self) -> tune.Checkpoint | None:
        if self._checkpoint_bytes is None:
            return None
        if self._checkpoint_dir is None:
            tag = f"{self._copies_tag}-" if self._copies_tag else ""
            directory = tempfile.mkdtemp(prefix=f"{leftovers.owned(RESTORED_PREFIX)}{tag}")
            self._checkpoint_dir = parcels.unpack(self._checkpoint_bytes, directory)
        return tune.Checkpoint.from_directory(self._checkpoint_dir)

    def report(self, metrics: dict, *, checkpoint: tune.Checkpoint | None = None) -> None:
        """Rank 0's report goes to Tune and returns once Tune has taken it (its checkpoint
        persisted in the trial's storage), as Ray's own report does: however fast the
        function reports, one report at a time is on its way. Other ranks' are dropped.
        """
        if self._rank != 0:
            return
        # Packed now: the caller may delete the directory as soon as report returns. The
        # trial's actor has read the file once the report is delivered.
        parcel = parcels.pack_to_file(checkpoint)
        try:
            post_and_wait_delivered(Report(dict(metrics), parcel))
        finally:
            parcels.remove(parcel)

    def close(self) -> None:
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)


def install_session(session: TrialSession | None) -> None:
    """Makes ``session`` the process-wide session Tune's functions read.

    ``ray.tune.report`` and ``ray.tune.get_checkpoint`` look up
    ``ray.train._internal.session._session`` (Ray 2.60); ``_ray_internals`` checked at
    import that it is there, and test_tune checks that Tune reads it.
    """
    train_session._session = session


def sweep_stale(root: str | None = None) -> list[str]:
    """Removes the checkpoint copies (restored on a rank, or on their way to Tune) that a
    process left when it was killed and nothing removed them after it (a trial's actor
    killed with its ranks, a node's copies that :func:`remove_restored_copies` did not
    reach). A copy's folder names its process; a process that is gone leaves a copy
    nobody reads. Run as a trial starts, on its actor and its ranks. Returns the folders
    removed.

    Args:
        root: Where the copies are made (the temporary folder by default).
    """
    return leftovers.sweep_stale((RESTORED_PREFIX, FORWARDED_PREFIX, parcels.PARCEL_PREFIX), root)


def remove_restored_copies(copies_tag: str, node_ids: Iterable[str]) -> None:
    """Removes the copies of the restored checkpoint that a stopped job's ranks made.

    Runs on the trial's actor once the job is stopped: a rank killed mid-trial (a trial
    stopped or paused by a scheduler, a failed one) never removes its own copy. On the
    actor's node directly, on the job's other nodes by a task pinned to each. A copy
    missed here (its node lost, the task late) is a leftover that :func:`sweep_stale`
    removes when a later trial starts there.

    Args:
        copies_tag: The job's tag, as its ranks' sessions were given it.
        node_ids: The Ray nodes the job's ranks ran on.
    """
    if not copies_tag:
        return
    here = ray.get_runtime_context().get_node_id()
    node_ids = set(node_ids)
    if here in node_ids:
        _remove_tagged(copies_tag)
    strategies = {
        node: NodeAffinitySchedulingStrategy(node, soft=False) for node in node_ids - {here}
    }
    refs = {
        _remove_on_node.options(scheduling_strategy=strategy).remote(copies_tag): node
        for node, strategy in strategies.items()
    }
    if not refs:
        return
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=REMOVE_TIMEOUT_S)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            logger.warning("restored checkpoint copies on node %s not removed: %s", refs[ref], err)
    for ref in late:
        logger.warning(
            "restored checkpoint copies on node %s not removed within %gs",
            refs[ref],
            REMOVE_TIMEOUT_S,
        )


def _remove_tagged(copies_tag: str, root: str | None = None) -> list[str]:
    """Removes the restored copies tagged ``copies_tag`` in ``root`` (the temporary
    folder by default), whichever process made them; returns their names."""
    root = tempfile.gettempdir() if root is None else root
    removed = []
    for name in os.listdir(root):
        parts = name[len(RESTORED_PREFIX) :].split("-", 2)
        if name.startswith(RESTORED_PREFIX) and len(parts) == 3 and parts[1] == copies_tag:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


_remove_on_node = ray.remote(num_cpus=0, max_retries=0)(_remove_tagged)


def remove_forwarded_copies() -> None:
    """Removes this process's copies of rank 0's checkpoints on their way to Tune: run
    on the trial's actor when Tune stops the trial, whose report may still hold one."""
    root = tempfile.gettempdir()
    prefix = f"{FORWARDED_PREFIX}{os.getpid()}-"
    for name in os.listdir(root):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def rank_main(
    func: Callable[[dict], Any],
    config: dict,
    checkpoint: bytes | None,
    trial: TrialFacts,
    copies_tag: str = "",
) -> None:
    """Runs a trial's function on a rank, under a :class:`TrialSession`."""
    sweep_stale()
    session = TrialSession(int(os.environ["HOROVOD_RANK"]), checkpoint, trial, copies_tag)
    install_session(session)
    report.use_tune_session(session)  # horovod_ray.report / get_checkpoint go to Tune too
    try:
        func(config)
    finally:
        report.use_tune_session(None)
        install_session(None)
        session.close()


def forward(item: object) -> None:
    """Runs on the trial's actor: hands one of rank 0's reports to Tune."""
    if not isinstance(item, Report):
        return  # horovod_ray.log() dicts have no meaning to Tune
    if item.checkpoint is None:
        tune.report(item.metrics)
        return
    directory = tempfile.mkdtemp(prefix=leftovers.owned(FORWARDED_PREFIX))
    try:
        parcels.unpack_parcel(item.checkpoint, directory)
        # Tune persists the checkpoint to the trial's storage before report returns.
        tune.report(item.metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
