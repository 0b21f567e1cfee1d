"""HorovodTrainer on a real local Ray: a Ray Train script's loop, with Ray's own functions
and config objects, runs on Horovod ranks (horovod.torch) and fit() answers as Ray's."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import ray.data
import ray.train
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig

from horovod_ray import HorovodTrainer
from test.conftest import start_local_ray

pytestmark = pytest.mark.timeout(240)

# Ray Data's own actors, made once per Ray by its first dataset: (name, namespace).
_RAY_DATA_ACTORS = [
    ("AutoscalingCoordinator", "AutoscalingCoordinator"),
    ("datasets_stats_actor", "_dataset_stats_actor"),
]


@pytest.fixture(scope="module")
def ray_data():
    """Ray Data's own actors made before the tests' leak checks look (they are Ray
    Data's, kept for the Ray's life), and removed after the module, as the later modules'
    leak checks expect the Ray as it was."""
    start_local_ray(4)
    ray.data.range(1).materialize()
    yield
    for name, namespace in _RAY_DATA_ACTORS:
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=namespace))


def train_loop(config):
    """A Ray Train loop as Ray's docs write one: only ray.train and hvd in it."""
    import horovod.torch as hvd
    import ray.train.collective  # on the rank: Train v2's (collection turns v2 off here)
    import torch

    hvd.init()
    context = ray.train.get_context()
    ray.train.collective.barrier()
    config["from_rank_0"] = ray.train.collective.broadcast_from_rank_zero(hvd.rank())
    start = 0
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "epoch").read_text())
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start, config["epochs"]):
        seen = sum(len(b["x"]) for b in shard.iter_torch_batches(batch_size=4))
        total = float(hvd.allreduce(torch.tensor(float(seen)), op=hvd.Sum))
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "epoch").write_text(str(epoch + 1))
            metrics = {"epoch": epoch + 1, "rows": total, "size": context.get_world_size()}
            metrics["from_rank_0"] = config["from_rank_0"]
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        hvd.broadcast_object(None)  # rank 0's checkpoint is committed before rank 1 may die
        if epoch == config.get("die_after") and hvd.rank() == 1 and _first_attempt():
            os._exit(3)  # a rank dies
    return start


def _first_attempt() -> bool:
    import horovod_ray

    return horovod_ray.attempt() == 0


def test_a_ray_train_loop_runs_and_fit_returns_rays_result(ray_data, ray_4cpu, no_leaks, tmp_path):
    trainer = HorovodTrainer(
        train_loop,
        train_loop_config={"epochs": 2},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="loop", storage_path=str(tmp_path)),
        datasets={"train": ray.data.range(40).map(lambda row: {"x": row["id"]})},
    )
    result = trainer.fit()
    assert isinstance(result, ray.train.Result)
    # Each epoch every rank read its part of the 40 rows; the ranks agreed on the sum.
    assert result.metrics == {"epoch": 2, "rows": 40.0, "size": 2, "from_rank_0": 0}
    with result.checkpoint.as_directory() as folder:
        assert Path(folder, "epoch").read_text() == "2"
    assert list(result.metrics_dataframe["epoch"]) == [1, 2]
    assert [metrics["epoch"] for _, metrics in result.best_checkpoints] == [1, 2]
    assert result.path == str(tmp_path / "loop") and result.error is None
    assert result.return_value == 0  # rank 0's: it started from epoch 0


def test_failure_config_restarts_from_the_latest_checkpoint_then_fails_as_rays(
    ray_data, ray_4cpu, no_leaks, tmp_path
):
    data = {"train": ray.data.range(8).map(lambda row: {"x": row["id"]})}
    trainer = HorovodTrainer(
        train_loop,
        train_loop_config={"epochs": 3, "die_after": 0},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="again", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1)
        ),
        datasets=data,
    )
    result = trainer.fit()
    assert result.metrics["epoch"] == 3 and list(result.metrics_dataframe["epoch"]) == [1, 2, 3]
    # The restart began after epoch 1, whose checkpoint rank 0 had committed (Ray's report
    # uploads before it returns) before rank 1 died: the loop's return value says so.
    assert result.return_value == 1

    failing = HorovodTrainer(
        train_loop,
        train_loop_config={"epochs": 3, "die_after": 0},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="once", storage_path=str(tmp_path)),
        datasets=data,
    )
    with pytest.raises(ray.train.WorkerGroupError) as info:
        failing.fit()
    assert 1 in info.value.worker_failures  # the rank that died, named


def tuned_loop(config):
    """A loop whose config a Tuner tunes (``scale``), resuming from its trial's
    checkpoint; rank 1 dies once per trial after the first epoch's report."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    start = 0
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "epoch").read_text())
    for epoch in range(start, config["epochs"]):
        total = float(hvd.allreduce(torch.tensor(config["scale"]), op=hvd.Sum))
        size = ray.train.get_context().get_world_size()
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "epoch").write_text(str(epoch + 1))
            metrics = {"epoch": epoch + 1, "total": total, "size": size, "start": start}
            metrics["kept"] = config["kept"]
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        hvd.broadcast_object(None)  # rank 0's report is with Tune before rank 1 may die
        died = Path(config["marks"], f"died-{config['scale']}")
        if hvd.rank() == 1 and not died.exists():
            died.touch()
            os._exit(3)


def test_a_tuner_runs_each_trial_as_a_horovod_job_and_retries_it_from_its_checkpoint(
    ray_data, ray_4cpu, no_leaks, tmp_path
):
    from ray import tune

    trainer = HorovodTrainer(
        tuned_loop,
        train_loop_config={"epochs": 2, "scale": 0.0, "kept": "yes", "marks": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        # The trainer's RunConfig is the experiment's when the Tuner has none, as in Ray.
        run_config=RunConfig(
            name="tuned", storage_path=str(tmp_path), failure_config=FailureConfig(1)
        ),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"scale": tune.grid_search([1.0, 2.0])}},
        tune_config=tune.TuneConfig(metric="total", mode="max"),
    )
    grid = tuner.fit()
    assert not grid.errors
    results = sorted(grid, key=lambda result: result.metrics["total"])
    # Each trial: two ranks summed its scale; its config merged into the trainer's; rank 1
    # died after epoch 1 and the retry resumed from epoch 1's checkpoint.
    for result, scale in zip(results, (1.0, 2.0), strict=True):
        assert {k: result.metrics[k] for k in ("epoch", "total", "size", "start", "kept")} == {
            "epoch": 2, "total": 2 * scale, "size": 2, "start": 1, "kept": "yes"
        }  # fmt: skip
        assert Path(result.path).parent == tmp_path / "tuned"
    assert sorted(path.name for path in tmp_path.glob("died-*")) == ["died-1.0", "died-2.0"]


def elastic_loop(config):
    """An elastic Horovod loop (hvd.elastic.run) reporting through Ray's functions."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    state = hvd.elastic.TorchState(epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < config["epochs"]:
            total = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum))
            state.epoch += 1
            context = ray.train.get_context()
            elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # horovod's elastic driver
            ray.train.report({"epoch": state.epoch, "total": total,
                              "size": context.get_world_size(), "elastic": elastic})  # fmt: skip
            state.commit()
        return state.epoch

    return train(state)


def test_an_elastic_scaling_config_runs_the_loop_on_an_elastic_job(
    ray_data, ray_4cpu, no_leaks, tmp_path
):
    trainer = HorovodTrainer(
        elastic_loop,
        train_loop_config={"epochs": 3},
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="elastic", storage_path=str(tmp_path)),
    )
    result = trainer.fit()
    # An elastic job (4 CPUs free: its most ranks) ran the loop to its end. Its resizes
    # are test/job/test_elastic.py's: on one machine a failed rank ends an elastic job
    # (its node leaves the job, as under horovodrun; docs/elastic.rst).
    assert result.metrics == {"epoch": 3, "total": 2.0, "size": 2, "elastic": True}
    assert result.return_value == 3
