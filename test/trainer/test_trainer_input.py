"""HorovodTrainer's arguments checked when it is made, without Ray: each bad one a
ConfigError naming it, and Ray's config objects read as run() reads them."""

from __future__ import annotations

import pytest
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.horovod import HorovodConfig

from horovod_ray import ConfigError, HorovodTrainer, RayExecutor

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def _loop(config):
    return config


@pytest.mark.parametrize(
    "arguments, parameter",
    [
        ({"train_loop_per_worker": "train.py"}, "train_loop_per_worker"),
        ({"train_loop_per_worker": lambda a, b: None}, "train_loop_per_worker"),
        ({"train_loop_config": [("lr", 0.1)]}, "train_loop_config"),
        ({"horovod_config": {"timeout_s": 5}}, "horovod_config"),
        ({"horovod_config": HorovodConfig(timeout_s=-1)}, "horovod_config.timeout_s"),
        ({"horovod_config": HorovodConfig(nics={"eth0", "ens5"})}, "horovod_config.nics"),
        (
            {"horovod_config": RayExecutor.create_settings(storage_path="/tmp/runs")},
            "horovod_config",
        ),
        ({"scaling_config": ScalingConfig(num_workers=2, placement_strategy="SPREAD")},
         "scaling_config.placement_strategy"),
        ({"run_config": RunConfig(failure_config=FailureConfig(max_failures=-1))},
         "run_config.failure_config.max_failures"),
        ({"resume_from_checkpoint": object()}, "resume_from_checkpoint"),
        ({"metadata": {"a": 1}}, "metadata"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_refused_when_the_trainer_is_made(arguments, parameter):
    arguments = {"train_loop_per_worker": _loop, **arguments}
    with pytest.raises(ConfigError) as info:
        HorovodTrainer(**arguments)
    assert info.value.parameter == parameter


def test_rays_defaults_hold_where_nothing_is_given(tmp_path):
    trainer = HorovodTrainer(
        _loop,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="n", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=2)
        ),
        dataset_config=DataConfig(),
    )
    assert trainer._settings.timeout_s == 300  # HorovodConfig's default
    assert trainer._settings.storage.run_path == str(tmp_path / "n")
    assert trainer._max_restarts == 2
    plain = HorovodTrainer(_loop)
    assert plain._settings.storage.run_path.startswith(str(RunConfig().storage_path))


def test_fit_reads_its_run_back_on_the_runs_own_filesystem(tmp_path, fresh_rank_session):
    import pyarrow.fs

    import horovod_ray
    from horovod_ray.trainer.horovod_trainer import as_ray_result

    filesystem = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    settings = RayExecutor.create_settings(
        storage_path="runs", name="n", storage_filesystem=filesystem
    )
    empty = as_ray_result(settings.storage, 7)  # nothing reported yet: no folder
    assert (empty.metrics, empty.checkpoint, empty.return_value) == (None, None, 7)
    horovod_ray.run(lambda: horovod_ray.report({"step": 1}), local=True, settings=settings)
    result = as_ray_result(settings.storage, 7)
    assert result.metrics == {"step": 1} and list(result.metrics_dataframe["step"]) == [1]
    assert (tmp_path / "runs" / "n").is_dir()  # on the filesystem given, not the local one


def test_a_tuner_takes_the_trainer_as_one_of_rays(tmp_path):
    from ray import tune
    from ray.train.trainer import BaseTrainer
    from ray.tune.experiment import Experiment

    trainer = HorovodTrainer(
        _loop,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}),
        run_config=RunConfig(
            name="n",
            storage_path=str(tmp_path),
            failure_config=FailureConfig(max_failures=2),
            checkpoint_config=CheckpointConfig(2, "loss", "min"),
        ),
    )
    assert isinstance(trainer, BaseTrainer)  # what Ray's Tuner asks before as_trainable()
    # The experiment's RunConfig, in Tune's form (Train v2's is not Tune's).
    run = trainer.run_config
    assert isinstance(run, tune.RunConfig)
    assert (run.name, run.storage_path, run.failure_config.max_failures) == (
        "n", str(tmp_path), 2
    )  # fmt: skip
    keep = run.checkpoint_config
    assert (keep.num_to_keep, keep.checkpoint_score_attribute, keep.checkpoint_score_order) == (
        2, "loss", "min"
    )  # fmt: skip
    trainable = trainer.as_trainable()
    # What Tuner.fit() makes of them (Tune refuses Train's CheckpointConfig here).
    Experiment("n", trainable, storage_path=str(tmp_path), checkpoint_config=keep)
    # Each trial reserves the job's ranks (an empty head bundle: its actor takes nothing).
    request = trainable.default_resource_request({})
    assert request.head_bundle_is_empty and request.bundles == [{"CPU": 2.0}, {"CPU": 2.0}]
    assert request.strategy == "PACK"
    spread = HorovodTrainer(
        _loop, scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD")
    ).as_trainable()
    assert spread.default_resource_request({}).strategy == "STRICT_SPREAD"


@pytest.mark.parametrize(
    "arguments, parameter",
    [
        ({"scaling_config": ScalingConfig(num_workers=(1, 2))}, "scaling_config.num_workers"),
        ({"horovod_config": RayExecutor.create_settings(timeline="/tmp/t.json")},
         "horovod_config"),
    ],
)  # fmt: skip
def test_what_a_tuners_trial_cannot_run_is_refused_as_the_tuner_is_made(arguments, parameter):
    trainer = HorovodTrainer(_loop, **arguments)
    with pytest.raises(ConfigError) as info:
        trainer.as_trainable()
    assert info.value.parameter == parameter


def test_a_trial_tunes_only_the_loops_config():
    from horovod_ray.trainer.horovod_trainer import _refuse_tuned

    _refuse_tuned({"train_loop_config": {"lr": 0.1}, "__trial_index__": 0})  # Tune's own key
    # A trial's actor refuses the rest as the trial starts, fresh or on a reused actor.
    trainable = HorovodTrainer(_loop).as_trainable()
    for begin in (trainable.setup, trainable.reset_config):
        with pytest.raises(ConfigError, match=r"\['scaling_config'\]") as info:
            begin(object.__new__(trainable), {"scaling_config": {"num_workers": 4}})
        assert info.value.parameter == "param_space"
