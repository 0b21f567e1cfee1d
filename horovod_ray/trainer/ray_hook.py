"""Ray's own ``ray.train`` functions on a rank of a ``HorovodTrainer`` job: the one module
that reaches into Ray Train's internals.

Ray Train v2 (Ray 2.60's default) answers ``ray.train.report``, ``get_context``,
``get_checkpoint``, ``get_dataset_shard``, ``get_all_reported_checkpoints``,
``get_preemption_info`` and ``ray.train.collective`` through one object per process, a
``TrainFnUtils``, that its workers install with ``set_train_fn_utils`` (its docstring
invites patching it). Ray has no public way for another backend to provide them, so this
module installs one of its own around the training function, answering from horovod_ray's
rank functions. ``test/trainer/test_ray_hook.py`` fails the day Ray changes these names or
what they must implement.

Ray Train v1 (``RAY_TRAIN_V2_ENABLED=0``) is not served: its functions warn and return
None on these ranks.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Mapping

import ray

from horovod_ray.errors import HorovodRayError

try:
    from ray.train.v2._internal.execution import train_fn_utils as _ray_fn_utils
    from ray.train.v2.api.context import TrainContext as _RayContext
    from ray.train.v2.api.report_config import CheckpointUploadMode
except ImportError as err:  # a Ray without Train v2's internals as 2.60 has them
    raise HorovodRayError(
        f"horovod_ray's HorovodTrainer serves ray.train's functions through Ray Train v2's "
        f"TrainFnUtils (Ray 2.60); this Ray ({ray.__version__}) has none: {err}"
    ) from err

# What Ray 2.60's TrainFnUtils and TrainContext ask of an implementation: the test holds
# Ray to these, and this module implements each.
FN_UTILS_METHODS = frozenset(
    {
        "report",
        "get_checkpoint",
        "get_all_reported_checkpoints",
        "get_dataset_shard",
        "get_context",
        "get_preemption_info",
        "is_distributed",
        "barrier",
        "broadcast_from_rank_zero",
    }
)
CONTEXT_METHODS = frozenset(
    {
        "get_experiment_name",
        "get_world_size",
        "get_world_rank",
        "get_local_rank",
        "get_local_world_size",
        "get_node_rank",
        "get_storage",
    }
)


class RankContext(_RayContext):
    """``ray.train.get_context()`` on a rank: horovod_ray's ``get_context()``'s answers."""

    def __init__(self) -> None:
        from horovod_ray.rank import context

        self._ours = context.get_context()

    def get_experiment_name(self) -> str:
        return self._ours.get_experiment_name()

    def get_world_size(self) -> int:
        return self._ours.get_world_size()

    def get_world_rank(self) -> int:
        return self._ours.get_world_rank()

    def get_local_rank(self) -> int:
        return self._ours.get_local_rank()

    def get_local_world_size(self) -> int:
        return self._ours.get_local_world_size()

    def get_node_rank(self) -> int:
        return self._ours.get_node_rank()

    def get_storage(self) -> Any:
        """horovod_ray's ``RunStorage`` (``filesystem``, ``run_path``), not Ray's
        ``StorageContext``; None without a storage path."""
        return self._ours.get_storage()


class RankFnUtils(_ray_fn_utils.TrainFnUtils):
    """Ray Train v2's per-process answers, given by horovod_ray's rank functions."""

    def report(self, metrics: dict, checkpoint: Any = None, **options: Any) -> None:
        """horovod_ray's ``report``; Ray's ``report`` fills in the deletion its upload
        mode implies, which stands here for not given (so that a checkpoint reported on
        a preemption notice is still removed once committed). Unlike Ray's, it is no
        barrier: only rank 0's reports count, and the others return at once."""
        from horovod_ray.rank import report

        mode = options.get("checkpoint_upload_mode")
        delete = options.get("delete_local_checkpoint_after_upload")
        if mode is not None and delete == mode.default_delete_local_checkpoint_after_upload():
            options["delete_local_checkpoint_after_upload"] = None
        if report.tune_session() is not None and mode is CheckpointUploadMode.SYNC:
            # A Tuner's trial: Ray's default mode is what Tune's report does (it returns
            # once the checkpoint is persisted); Tune takes no upload options.
            options["checkpoint_upload_mode"] = None
        report.report(metrics, checkpoint, **options)

    def get_checkpoint(self) -> Any:
        from horovod_ray.rank import report

        return report.get_checkpoint()

    def get_all_reported_checkpoints(
        self, consistency_mode: Any = None, timeout_s: float | None = None
    ) -> list:
        from horovod_ray.rank import report

        return report.get_all_reported_checkpoints(consistency_mode, timeout_s)

    def get_dataset_shard(self, dataset_info: Any) -> Any:
        from horovod_ray.rank import datasets

        return datasets.get_dataset_shard(dataset_info.dataset_name)

    def get_context(self) -> RankContext:
        return RankContext()

    def get_preemption_info(self) -> Any:
        from horovod_ray.rank import preemption

        return preemption.get_preemption_info()

    def is_distributed(self) -> bool:
        return True

    def barrier(self) -> None:
        # A broadcast every rank waits in: horovod.tensorflow has no barrier().
        _horovod().broadcast_object(None, root_rank=0)

    def broadcast_from_rank_zero(self, data: Any) -> Any:
        return _horovod().broadcast_object(data, root_rank=0)


def _horovod() -> Any:
    """The horovod framework module the training function initialised."""
    for name in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_initialized():
            return module
    raise HorovodRayError(
        "ray.train.collective needs Horovod running on the rank: call hvd.init() first "
        "(import horovod.torch or horovod.tensorflow as hvd)"
    )


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Ray Train v2's functions answer on this rank (this process) while inside."""
    try:
        previous = _ray_fn_utils.get_train_fn_utils()
    except RuntimeError:  # none installed: Ray's functions refuse, outside a worker
        previous = None
    _ray_fn_utils.set_train_fn_utils(RankFnUtils())
    try:
        yield
    finally:
        _ray_fn_utils.set_train_fn_utils(previous)


def takes_config(train_loop: Callable[..., Any]) -> bool:
    """Whether ``train_loop`` takes Ray's ``config`` (one required argument) or nothing,
    as Ray Train calls it.

    Raises:
        ValueError: It needs more than one argument.
    """
    from ray.train._internal.utils import count_required_parameters

    required = count_required_parameters(train_loop)  # as Ray counts them (*args is one)
    if required > 1:
        raise ValueError(
            f"train_loop_per_worker should take in 0 or 1 required arguments, but it "
            f"accepts {required} required arguments instead"
        )
    return required == 1


def let_tuner_take(trainer_cls: type) -> None:
    """Makes ``ray.tune.Tuner`` take ``trainer_cls``'s instances as it takes Ray's own
    trainers: Ray 2.60's Tuner asks ``isinstance(trainable, BaseTrainer)`` (Ray Train v1's
    trainer base), then reads the trainer's ``run_config`` and runs
    ``trainer.as_trainable()``. A virtual subclass: nothing of BaseTrainer is inherited.
    """
    from ray.train.trainer import BaseTrainer

    BaseTrainer.register(trainer_cls)


def trial_on_rank(
    train_loop: Callable[..., Any],
    config: dict,
    with_config: bool,
    trial_config: dict,
) -> Any:
    """What each rank of a Tuner's trial runs: ``train_loop`` with the trial's
    ``train_loop_config`` merged into ``config`` (nested dicts key by key, as Ray's
    trainers merge a Tuner's ``param_space``), and Ray's functions answering."""
    from horovod_ray.tune import session

    # Ray's ray.train functions refuse to run inside a Tune session (they point at
    # ray.tune's); this rank's reports still reach the trial (report.use_tune_session).
    session.install_session(None)
    tuned = trial_config.get("train_loop_config") or {}
    return loop_on_rank(train_loop, merged(config, tuned), with_config)


def merged(base: Mapping[str, Any], tuned: Mapping[str, Any]) -> dict:
    """``base`` updated with ``tuned``, nested mappings merged key by key."""
    result = dict(base)
    for key, value in tuned.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def loop_on_rank(train_loop: Callable[..., Any], config: dict, with_config: bool) -> Any:
    """What each rank runs: ``train_loop(config)`` (or ``train_loop()``) with Ray's
    functions answering."""
    with installed():
        return train_loop(config) if with_config else train_loop()
