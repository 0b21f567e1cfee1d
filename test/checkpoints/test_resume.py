"""Checkpoints and resume on real Ray and real Horovod: restarts, new drivers, run names,
the executor, storage failures."""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Iterator

import pyarrow.fs
import pytest
from ray.train import Checkpoint, CheckpointConfig

import horovod_ray
from horovod_ray import CheckpointError, RayExecutor, Result, WorkerFailedError
from test.checkpointed_training import checkpointed_sum, expected_state
from test.conftest import alive_actors

pytestmark = pytest.mark.timeout(240)


def _steps(result: Result) -> list[int]:
    return [metrics["step"] for _, metrics in result.best_checkpoints]


@pytest.mark.parametrize(
    "framework, as_uri", [("torch", False), ("tensorflow", True)], ids=["torch", "tensorflow-uri"]
)
def test_a_restart_resumes_at_the_failed_step_on_every_rank(
    ray_4cpu, no_leaks, tmp_path, framework, as_uri
):
    storage_path = f"file://{tmp_path}" if as_uri else str(tmp_path)
    results = horovod_ray.run(
        checkpointed_sum,
        args=[{"steps": 6, "die_at": 3, "framework": framework}],
        num_slots=2,
        max_restarts=1,
        storage_path=storage_path,
        name="run",
        checkpoint_config=CheckpointConfig(num_to_keep=2),
    )
    # Rank 1 died at step 3 once step 3's checkpoint was committed: both ranks of the
    # second attempt started there, and the sum is an uninterrupted run's.
    assert [r["resumed_from"] for r in results] == [3, 3]
    assert [r["state"] for r in results] == [expected_state(6)] * 2
    result = Result.from_path(f"{storage_path}/run")
    assert result.metrics == {"state": expected_state(6), "step": 6, "resumed_from": [3, 3]}
    assert _steps(result) == [5, 6]  # num_to_keep=2: the newest two
    with result.checkpoint.as_directory() as directory:
        assert '"step": 6' in open(os.path.join(directory, "state.json")).read()
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint_000005",
        "checkpoint_000005.json",
        "checkpoint_000006",
        "checkpoint_000006.json",
        "metrics.json",
    ]


def test_a_new_driver_resumes_its_run_and_another_name_starts_over(ray_4cpu, no_leaks, tmp_path):
    # Not the plain local filesystem: a pyarrow SubTreeFileSystem, which travels pickled.
    filesystem = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    storage = {"storage_path": "runs", "storage_filesystem": filesystem}
    first = horovod_ray.run(checkpointed_sum, args=[{"steps": 2}], num_slots=2, name="a", **storage)
    again = horovod_ray.run(checkpointed_sum, args=[{"steps": 5}], num_slots=2, name="a", **storage)
    other = horovod_ray.run(checkpointed_sum, args=[{"steps": 1}], num_slots=2, name="b", **storage)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert [r["resumed_from"] for r in again] == [2, 2]
    assert [r["state"] for r in again] == [expected_state(5)] * 2
    assert [r["resumed_from"] for r in other] == [0, 0]  # "a"'s checkpoints are not "b"'s
    assert _steps(Result.from_path("runs/a", filesystem)) == [1, 2, 3, 4, 5]
    assert _steps(Result.from_path("runs/b", filesystem)) == [1]
    assert sorted(os.listdir(tmp_path / "runs")) == ["a", "b"]


def test_an_executor_with_a_storage_resumes_in_its_next_job(ray_4cpu, no_leaks, tmp_path):
    settings = RayExecutor.create_settings(timeout_s=60, storage_path=str(tmp_path), name="x")
    resumed = []
    for steps in (2, 3):
        with RayExecutor(settings, num_workers=2) as executor:  # started on entry
            results = executor.run(checkpointed_sum, args=[{"steps": steps}])
            resumed.append([r["resumed_from"] for r in results])
    assert resumed == [[0, 0], [2, 2]]
    assert Result.from_path(f"{tmp_path}/x").metrics["state"] == expected_state(3)


def _upload_then_break_the_storage(run_path: str) -> None:
    """Rank 0 reports a checkpoint, waits until it is committed and its metrics written,
    replaces the run's folder with a file, and reports another: its upload fails. (Broken
    between the two writes, the first report's metrics fail instead: seen once in CI.)"""
    import tempfile

    done = [f"{run_path}/checkpoint_000001.json", f"{run_path}/metrics.json"]
    for step in (1, 2):
        with tempfile.TemporaryDirectory() as directory:
            horovod_ray.report({"step": step}, checkpoint=Checkpoint.from_directory(directory))
        while step == 1 and not all(os.path.exists(path) for path in done):
            time.sleep(0.05)
        if step == 1:
            os.rename(run_path, f"{run_path}.moved")
            open(run_path, "w").close()


def test_a_failed_upload_fails_the_job_with_a_checkpoint_error(ray_4cpu, no_leaks, tmp_path):
    with pytest.raises(
        WorkerFailedError, match=r"CheckpointError: could not list the run.s folder"
    ):
        horovod_ray.run(
            _upload_then_break_the_storage,
            args=[f"{tmp_path}/r"],
            num_slots=1,
            storage_path=str(tmp_path),
            name="r",
        )
    assert sorted(os.listdir(tmp_path / "r.moved")) == [
        "checkpoint_000001",
        "checkpoint_000001.json",
        "metrics.json",
    ]


def test_a_storage_that_cannot_be_read_fails_before_any_rank_starts(ray_4cpu, no_leaks, tmp_path):
    (tmp_path / "run").write_text("")  # where the run's folder should be
    with pytest.raises(CheckpointError, match=r"could not list the run's folder .*/run: "):
        horovod_ray.run(os.getpid, num_slots=2, storage_path=str(tmp_path), name="run")
    assert alive_actors() == []


def _elastic_steps(steps: int) -> int:
    """horovod's elastic loop, reporting a checkpoint after each commit; returns the step
    this run started from."""
    import tempfile

    import horovod.torch as hvd
    import torch

    hvd.init()
    start = 0
    checkpoint = horovod_ray.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = int(open(os.path.join(directory, "step")).read())
    state = hvd.elastic.TorchState(step=start)  # no model: the step alone

    @hvd.elastic.run
    def loop(state) -> None:
        while state.step < steps:
            hvd.allreduce(torch.tensor(1.0))
            state.step += 1
            state.commit()
            with tempfile.TemporaryDirectory() as directory:
                with open(os.path.join(directory, "step"), "w") as handle:
                    handle.write(str(state.step))
                horovod_ray.report(
                    {"step": state.step}, checkpoint=Checkpoint.from_directory(directory)
                )

    loop(state)
    return start


def test_an_elastic_jobs_reports_persist_and_its_next_run_resumes(ray_4cpu, no_leaks, tmp_path):
    storage = {"storage_path": str(tmp_path), "name": "elastic", "min_workers": 2}
    assert horovod_ray.run(_elastic_steps, args=[3], max_workers=2, **storage) == [0, 0]
    assert horovod_ray.run(_elastic_steps, args=[5], max_workers=2, **storage) == [3, 3]
    assert _steps(Result.from_path(f"{tmp_path}/elastic")) == [1, 2, 3, 4, 5]


def _reports_as_ray_train_makes_them(run_path: str) -> dict:
    """Ray Train 2.60's report(): the checkpoint positional, nested metrics, a bad metric
    refused without harm to the next report, and a synchronous upload."""
    import tempfile

    from horovod_ray import ConfigError

    def checkpoint(folder: str) -> Checkpoint:
        with open(os.path.join(folder, "model"), "w") as handle:
            handle.write("weights")
        return Checkpoint.from_directory(folder)

    for epoch, loss in enumerate([0.5, 0.1, 0.9]):
        with tempfile.TemporaryDirectory() as folder:
            horovod_ray.report({"epoch": epoch, "val": {"loss": loss}}, checkpoint(folder))
    try:
        horovod_ray.report({"epoch": 3, 0: "per-class"})
        refused = ""
    except ConfigError as err:
        refused = str(err)
    with tempfile.TemporaryDirectory() as folder:
        horovod_ray.report(
            {"epoch": 3, "val": {"loss": 0.7}}, checkpoint(folder), checkpoint_upload_mode="SYNC"
        )
        committed = os.path.exists(f"{run_path}/checkpoint_000004.json")
    return {"refused": refused, "committed_on_return": committed}


def test_report_takes_ray_trains_arguments_and_scores_nested_metrics(ray_4cpu, no_leaks, tmp_path):
    (tmp_path / "run").mkdir()
    # What a process killed while writing a marker leaves; removed when the job ends.
    (tmp_path / "run" / "checkpoint_000001.json.0a1b.partial").write_text('{"ind')
    [facts] = horovod_ray.run(
        _reports_as_ray_train_makes_them,
        args=[f"{tmp_path}/run"],
        num_slots=1,
        storage_path=str(tmp_path),
        name="run",
        checkpoint_config=CheckpointConfig(1, "val/loss", "min"),
    )
    assert facts == {
        "refused": "metrics keys must be str, got 0 (int) at the top level: name it with a "
        "str, e.g. '0'",
        "committed_on_return": True,
    }
    # The best by val/loss (epoch 1) and the latest stay.
    result = Result.from_path(f"{tmp_path}/run")
    assert [m["epoch"] for _, m in result.best_checkpoints] == [1, 3]
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint_000002",
        "checkpoint_000002.json",
        "checkpoint_000004",
        "checkpoint_000004.json",
        "metrics.json",
    ]


@pytest.fixture
def s3_server(monkeypatch) -> Iterator[tuple[str, dict[str, str]]]:
    """A local S3-compatible server (moto's) on loopback: its endpoint ("127.0.0.1:PORT")
    and the credentials every process talking to it needs (set on the driver here)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance metadata lookups off this host
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        yield f"{host}:{port}", env
    finally:
        server.stop()


def test_a_name_a_uri_cannot_carry_resumes_on_an_s3_endpoint_from_the_query(
    ray_4cpu, no_leaks, s3_server
):
    # The endpoint is only in the URI's query: a rank that lost it (a '#' in the name cut
    # it off) would talk to AWS instead and fail; a space or a '%' would not parse.
    endpoint, env = s3_server
    query = f"endpoint_override={endpoint}&scheme=http&region=us-east-1&allow_bucket_creation=true"
    storage = {"storage_path": f"s3://bucket/runs?{query}", "name": "exp#1 at 100% done"}
    first = horovod_ray.run(checkpointed_sum, args=[{"steps": 2}], num_slots=2, env=env, **storage)
    again = horovod_ray.run(checkpointed_sum, args=[{"steps": 3}], num_slots=2, env=env, **storage)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert [r["resumed_from"] for r in again] == [2, 2]
    result = Result.from_path(f"s3://bucket/runs/{urllib.parse.quote(storage['name'])}?{query}")
    assert result.metrics["state"] == expected_state(3)
    assert _steps(result) == [1, 2, 3]
