"""``horovod_ray.DataConfig``: Ray Train's ``DataConfig``, and whether epochs resume."""

from __future__ import annotations

from typing import Any

import ray.train

from horovod_ray.errors import ConfigError


class DataConfig(ray.train.DataConfig):
    """Ray Train's ``DataConfig`` (which datasets are split, Ray Data's execution options,
    locality), with one more choice.

    Args:
        datasets_to_split: As Ray's: ``"all"`` or the names of the datasets to split.
        execution_options: As Ray's.
        enable_shard_locality: As Ray's (streamed splits only).
        resumable: Split in order instead of streaming: each split dataset is
            materialized once as the job starts (its order kept), and each rank's
            iterator has ``state_dict()`` and ``load_state_dict()``, so that a restarted
            job, or an elastic job after a reset, reads on from where its epoch stood
            (docs/data.rst). An elastic job always splits so.

    Raises:
        ConfigError: ``resumable`` is not a bool.
    """

    def __init__(
        self,
        datasets_to_split: Any = "all",
        execution_options: Any = None,
        enable_shard_locality: bool = True,
        *,
        resumable: bool = False,
    ) -> None:
        super().__init__(datasets_to_split, execution_options, enable_shard_locality)
        if not isinstance(resumable, bool):
            raise ConfigError("resumable", f"resumable must be True or False, got {resumable!r}")
        self.resumable = resumable
