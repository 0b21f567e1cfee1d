"""``get_context()``: what Ray Train's ``ray.train.get_context()`` tells a training
function, for a rank of any entry point: ``run()``, ``RayExecutor``, the commands of
``horovod-ray run`` and Tune trials.

The numbers are horovod's own once ``hvd.init()`` ran in the process (an elastic reset
renumbers the ranks), else those the job gave the rank (``HOROVOD_RANK`` and the rest).
Only Ray Train's methods that mean something for a Horovod job are here, under Ray's
names; a Tune trial's rank also has the trial's (``TuneContext``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import HorovodRayError
from horovod_ray.observe.job import JOB_ID_ENV, JOB_NAME_ENV
from horovod_ray.rank import report

# horovod's function for each number, and the variable the job set it in.
_NUMBERS = {
    "rank": "HOROVOD_RANK",
    "size": "HOROVOD_SIZE",
    "local_rank": "HOROVOD_LOCAL_RANK",
    "local_size": "HOROVOD_LOCAL_SIZE",
    "cross_rank": "HOROVOD_CROSS_RANK",
}


class TrainContext:
    """A rank's place in its job, by Ray Train's ``TrainContext`` method names."""

    def get_world_size(self) -> int:
        """The number of ranks in the job (its world now, in an elastic job)."""
        return _number("size")

    def get_world_rank(self) -> int:
        """This rank's number, from 0 to ``get_world_size() - 1``."""
        return _number("rank")

    def get_local_rank(self) -> int:
        """This rank's number among the ranks on its node."""
        return _number("local_rank")

    def get_local_world_size(self) -> int:
        """The number of the job's ranks on this rank's node."""
        return _number("local_size")

    def get_node_rank(self) -> int:
        """horovod's cross rank: the number of this rank's node among the job's nodes
        where every node holds as many ranks (``num_hosts`` x ``num_slots``); with
        uneven nodes, this rank's number among the ranks of its local rank."""
        return _number("cross_rank")

    def get_experiment_name(self) -> str:
        """The job's name: ``run(name=...)``, ``create_settings(name=...)``, ``--name``,
        or the one made for it (its metrics' ``job_name``)."""
        return os.environ[JOB_NAME_ENV]

    def get_storage(self) -> RunStorage | None:
        """Where the job's checkpoints persist (``storage_path`` and ``name``: its
        ``filesystem`` and ``run_path``); None without a storage path."""
        return RunStorage.from_env()


class TuneContext(TrainContext):
    """A Tune trial's rank: also the trial's facts, as ``ray.tune.get_context()`` has
    them; the job is the trial's (``get_experiment_name`` is Tune's experiment)."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def get_experiment_name(self) -> str:
        return self._session.experiment_name

    def get_storage(self) -> Any:
        """The trial's storage, as Tune's context gives it."""
        return self._session.storage

    def get_trial_name(self) -> str:
        return self._session.trial_name

    def get_trial_id(self) -> str:
        return self._session.trial_id

    def get_trial_dir(self) -> str:
        return self._session.trial_dir

    def get_trial_resources(self) -> Any:
        return self._session.trial_resources


def get_context() -> TrainContext:
    """This rank's context (as ``ray.train.get_context()``): its world and local rank and
    size, its node's rank, the job's name and storage; in a Tune trial, the trial's too.

    Raises:
        HorovodRayError: Not on a rank of a horovod_ray job.
    """
    session = report.tune_session()
    if session is not None:
        return TuneContext(session)
    if JOB_ID_ENV not in os.environ:
        raise HorovodRayError(
            "get_context() answers on a rank of a horovod_ray job: inside the function "
            "run(), RayExecutor.run/execute or a Tune trial runs, or a command of "
            "horovod-ray run"
        )
    return TrainContext()


def _number(name: str) -> int:
    """horovod's ``name`` (``rank``, ``size``, ...) once it is initialised here, else
    the job's."""
    for framework in ("horovod.torch", "horovod.tensorflow"):
        module = sys.modules.get(framework)
        if module is not None:
            try:
                return int(getattr(module, name)())
            except Exception:  # noqa: BLE001 - not initialised under that framework
                continue
    return int(os.environ[_NUMBERS[name]])
