"""``HorovodTrainer``: Ray Train's ``HorovodTrainer``, which Ray 2.60 removed, over a
horovod_ray job. Its config objects go through ``horovod_ray.config`` as ``run()``'s do;
``fit()`` runs the job with ``run()`` and reads its run folder back as Ray's ``Result``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

from horovod_ray import config
from horovod_ray.checkpoints.result import Result as RunResult
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import ConfigError, WorkerFailedError, named_as
from horovod_ray.trainer import ray_hook


class HorovodTrainer:
    """Runs ``train_loop_per_worker`` on every rank of a Horovod job, as Ray Train's
    ``HorovodTrainer`` did (Ray 2.x; Ray 2.60 removed it): the same arguments, Ray's own
    config objects, and ``ray.train.report``, ``get_context``, ``get_checkpoint``,
    ``get_dataset_shard`` and ``get_all_reported_checkpoints`` answering inside the loop
    (Ray Train v2's, Ray's default).

    Args:
        train_loop_per_worker: The training function, taking ``config`` or nothing; it
            calls ``hvd.init()``.
        train_loop_config: Passed to it as ``config`` (None: ``{}``).
        horovod_config: A ``ray.train.horovod.HorovodConfig``: its ``timeout_s``,
            ``placement_group_timeout_s``, ``nics`` and ``verbose`` (its SSH fields mean
            nothing here: Ray starts the ranks); or horovod_ray's job settings
            (``RayExecutor.create_settings(...)``) without storage.
        scaling_config: A ``ray.train.ScalingConfig`` (``num_workers=N`` or
            ``(min, max)`` for an elastic job, ``use_gpu``, ``resources_per_worker``,
            ``placement_strategy``); None: one rank.
        run_config: A ``ray.train.RunConfig``: the run's ``name`` and ``storage_path``
            (Ray's default: ``~/ray_results``), ``checkpoint_config``, and
            ``failure_config``'s ``max_failures`` (a restart resumes from the latest
            checkpoint: ``ray.train.get_checkpoint()``).
        datasets: Ray Data for the ranks, name -> ``ray.data.Dataset``
            (``ray.train.get_dataset_shard(name)``).
        dataset_config: A ``ray.train.DataConfig``.
        resume_from_checkpoint: Not supported: give the run's ``name`` and
            ``storage_path`` again, and it resumes from its latest checkpoint.
        metadata: Not supported (Ray Train v2 refuses it too).

    Raises:
        ConfigError: A bad argument, naming it, before anything is started.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: Mapping[str, Any] | None = None,
        horovod_config: Any = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: Mapping[str, Any] | None = None,
        dataset_config: Any = None,
        resume_from_checkpoint: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        from ray.train import RunConfig, ScalingConfig

        if not callable(train_loop_per_worker):
            raise ConfigError(
                "train_loop_per_worker",
                f"train_loop_per_worker must be a function, got {train_loop_per_worker!r}",
            )
        try:
            self._with_config = ray_hook.takes_config(train_loop_per_worker)
        except ValueError as err:
            raise ConfigError("train_loop_per_worker", str(err)) from None
        if train_loop_config is not None and not isinstance(train_loop_config, Mapping):
            raise ConfigError(
                "train_loop_config",
                f"train_loop_config must be a dict, got {type(train_loop_config).__name__}",
            )
        for name, value, instead in (
            (
                "resume_from_checkpoint",
                resume_from_checkpoint,
                "give run_config=RunConfig(name=..., storage_path=...) of the run again: "
                "it resumes from its latest checkpoint",
            ),
            ("metadata", metadata, "Ray Train v2 refuses it too; drop it"),
        ):
            if value is not None:
                raise ConfigError(name, f"{name} is not supported by horovod_ray: {instead}")
        self._loop = train_loop_per_worker
        self._config = dict(train_loop_config or {})
        scaling_config = ScalingConfig() if scaling_config is None else scaling_config
        run_config = RunConfig() if run_config is None else run_config
        # Stored where Ray's trainers store a run that does not say where.
        wanted = config.from_ray(scaling_config, run_config).stored_at(_default_storage())
        self._horovod = config.horovod(horovod_config)
        self._settings = wanted.settings(self._horovod)
        self._scaling_config = scaling_config
        self._max_restarts = wanted.run.get("max_restarts", 0)
        self._datasets = datasets
        self._dataset_config = dataset_config
        self._run_config = run_config
        self._tune_run_config: Any = None

    @property
    def run_config(self) -> Any:
        """The ``ray.tune.RunConfig`` a ``Tuner`` given this trainer (and none of its
        own) runs its experiment with: ``run_config``'s name, storage, checkpoint keep
        policy and ``max_failures`` (retries of a failed trial)."""
        if self._tune_run_config is None:
            self._tune_run_config = config.for_tune(self._run_config)
        return self._tune_run_config

    @run_config.setter
    def run_config(self, value: Any) -> None:  # Tuner.restore gives the experiment's
        self._tune_run_config = value

    def fit(self) -> Any:
        """Runs the job to its end and returns its ``ray.train.Result`` (the last
        metrics, the latest checkpoint, the checkpoints kept, the run's folder, rank 0's
        return value).

        Raises:
            ray.train.WorkerGroupError: A rank failed (after the restarts of
                ``FailureConfig(max_failures)``); its ranks' errors in
                ``worker_failures``.
        """
        from ray.train import WorkerGroupError

        from horovod_ray.run import run

        try:
            values = run(
                ray_hook.loop_on_rank,
                args=(self._loop, self._config, self._with_config),
                scaling_config=self._scaling_config,
                settings=self._settings,
                max_restarts=self._max_restarts,
                datasets=self._datasets,
                data_config=self._dataset_config,
            )
        except WorkerFailedError as err:
            failures = {rank: RuntimeError(text) for rank, text in err.failures.items()}
            raise WorkerGroupError(str(err), failures) from err
        return as_ray_result(self._settings.storage, values[0])

    def as_trainable(self) -> type:
        """This trainer as a Tune Trainable, for ``ray.tune.Tuner(trainer, ...)`` (which
        calls it): every trial runs the loop on its own Horovod job of
        ``scaling_config``'s ranks, inside the trial's placement group, with the trial's
        ``param_space["train_loop_config"]`` merged into ``train_loop_config``. The
        Tuner's (or else this trainer's) RunConfig is the experiment's: Tune stores the
        trials' checkpoints and retries them (``FailureConfig(max_failures)``), from
        their latest checkpoint (``ray.train.get_checkpoint()``).

        Raises:
            ConfigError: An elastic ``scaling_config`` (a trial's job is static), or a
                ``horovod_config`` a trial cannot take (storage, timeline).
        """
        from horovod_ray.rank.calls import pickle_fn
        from horovod_ray.tune import trainable

        sizing = config.scaling(self._scaling_config)
        if "min_workers" in sizing:
            raise ConfigError(
                "scaling_config.num_workers",
                f"a Tune trial runs a static job: give scaling_config.num_workers a count, "
                f"got {self._scaling_config.num_workers!r}",
            )
        name = type(self).__name__
        with named_as({"settings": "horovod_config"}):
            settings = trainable.trial_settings(self._horovod, None, name)
        func = functools.partial(
            ray_hook.trial_on_rank, self._loop, self._config, self._with_config
        )
        pickle_fn("train_loop_per_worker", func)
        tuned = trainable.trial_trainable(
            func, sizing, settings, self._datasets, self._dataset_config, name, name
        )

        class HorovodTrainerTrainable(tuned):  # type: ignore[misc, valid-type]
            """A Tuner's trial of a HorovodTrainer."""

            def setup(self, config: dict, *args: Any, **kwargs: Any) -> None:
                _refuse_tuned(config)
                super().setup(config, *args, **kwargs)

            def reset_config(self, new_config: dict) -> bool:  # a reused actor's next trial
                _refuse_tuned(new_config)
                return super().reset_config(new_config)

        HorovodTrainerTrainable.__name__ = tuned.__name__
        HorovodTrainerTrainable.__qualname__ = tuned.__qualname__
        return HorovodTrainerTrainable


ray_hook.let_tuner_take(HorovodTrainer)


def _refuse_tuned(trial_config: Mapping[str, Any]) -> None:
    """A trial's ``param_space`` may tune ``train_loop_config`` alone.

    Raises:
        ConfigError: Naming the other keys.
    """
    # Tune's own keys (a Repeater's __trial_index__) are not the user's.
    others = sorted(key for key in trial_config if key != "train_loop_config" and key[:2] != "__")
    if others:
        raise ConfigError(
            "param_space",
            f"a Tuner of horovod_ray's HorovodTrainer tunes train_loop_config only, got "
            f"{others}: give the trainer its scaling_config and datasets",
        )


def as_ray_result(storage: RunStorage, return_value: Any) -> Any:
    """A finished run as Ray Train's ``Result``: its folder read back, and rank 0's
    return value. A run that reported nothing left no folder: no metrics then, as in
    Ray's."""
    import pandas
    from ray.train import Result

    try:
        result = RunResult.from_path(storage.run_path, storage.filesystem)
    except ConfigError:  # no folder: nothing was reported
        return Result(
            metrics=None,
            checkpoint=None,
            error=None,
            path=storage.run_path,
            _storage_filesystem=storage.filesystem,
            return_value=return_value,
        )
    rows = [metrics for _, metrics in result.best_checkpoints]
    if result.metrics and (not rows or rows[-1] != result.metrics):
        rows.append(result.metrics)  # the last report, when it came without a checkpoint
    return Result(
        metrics=result.metrics,
        checkpoint=result.checkpoint,
        error=None,
        path=result.path,
        metrics_dataframe=pandas.DataFrame(rows),
        best_checkpoints=result.best_checkpoints,
        _storage_filesystem=result.filesystem,
        return_value=return_value,
    )


def _default_storage() -> str:
    from ray.train.constants import DEFAULT_STORAGE_PATH

    return DEFAULT_STORAGE_PATH
