"""horovod_ray.run: one call, per-rank results in rank order, always stops."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

import horovod_ray
from horovod_ray import ConfigError, PlacementTimeoutError, WorkerFailedError, worker_output
from test.conftest import alive_actors, assert_two_attempts_spent, run_fresh_python
from test.test_executor import horovod_identity

pytestmark = pytest.mark.timeout(180)


def test_results_come_back_in_rank_order(ray_4cpu, no_leaks):
    results = horovod_ray.run(horovod_identity, num_hosts=1, num_slots=3, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["sum"] for r in results} == {6.0}
    assert results[0]["env"]["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "60"
    assert alive_actors() == []


def test_args_kwargs_env_and_callbacks_reach_the_ranks(ray_4cpu, no_leaks):
    def train(base, scale=1):
        horovod_ray.log({"rank": os.environ["HOROVOD_RANK"]})
        return (base + int(os.environ["HOROVOD_RANK"])) * scale, os.environ["MODE"]

    seen = []
    results = horovod_ray.run(
        train,
        args=[10],
        kwargs={"scale": 2},
        num_slots=2,
        env={"MODE": "test"},
        callbacks=[seen.append],
    )
    assert results == [(20, "test"), (22, "test")]
    assert seen == [{"rank": "0"}]


def test_a_failure_still_stops_everything(ray_4cpu, no_leaks):
    def train():
        if os.environ["HOROVOD_RANK"] == "1":
            raise KeyError("missing column")
        return "ok"

    with pytest.raises(WorkerFailedError, match="missing column") as info:
        horovod_ray.run(train, num_slots=2)
    assert list(info.value.failures) == [1]


def test_a_ranks_tensorflow_error_reaches_the_driver_without_importing_tensorflow(ray_4cpu):
    # Unpickling the error itself would import TensorFlow in the driver: seconds before the
    # failed job could be stopped, or restarted. (RankError.original() is test_errors'.)
    code = (
        "import os, sys, horovod_ray\n"
        "def train():\n"
        "    if os.environ['HOROVOD_RANK'] == '1':\n"
        "        import tensorflow as tf\n"
        "        raise tf.errors.UnknownError(None, None, 'the collective broke')\n"
        "try:\n"
        "    horovod_ray.run(train, num_slots=2)\n"
        "except horovod_ray.WorkerFailedError as err:\n"
        "    print('TENSORFLOW', 'tensorflow' in sys.modules)\n"
        "    print('FAILED', list(err.failures))\n"
        "    print('TEXT', repr(err.failures[1]))\n"
        "    cause = err.__cause__\n"
        "    print('CAUSE', type(cause).__name__, cause.type_name)\n"
    )
    out = run_fresh_python(code, timeout_s=180, join_ray=True)
    assert "TENSORFLOW False" in out
    assert "FAILED [1]" in out
    text = re.search(r"TEXT (.*)", out).group(1)  # the rank's traceback, without Ray's
    assert "Traceback (most recent call last)" in text and "in train" in text, text
    assert "tensorflow.python.framework.errors_impl.UnknownError: the collective broke" in text
    assert "ray::" not in text
    assert "CAUSE RankError tensorflow.python.framework.errors_impl.UnknownError" in out


def _resumes_from_its_checkpoint(folder: str) -> tuple[int, int]:
    """Four steps, rank 0 checkpointing each; in the first attempt rank 1 dies after its
    second step. Returns (the attempt, the step it started from)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    checkpoint = os.path.join(folder, "checkpoint")
    start = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
    for step in range(start, 4):
        hvd.allreduce(torch.tensor(1.0))
        if hvd.rank() == 0:
            with open(checkpoint + ".tmp", "w") as handle:
                handle.write(str(step + 1))
            os.replace(checkpoint + ".tmp", checkpoint)
        if step == 1 and horovod_ray.attempt() == 0 and hvd.rank() == 1:
            os._exit(3)  # a rank dies mid-run
    return horovod_ray.attempt(), start


def test_a_placement_the_cluster_cannot_hold_fails_within_runs_own_timeout(ray_4cpu, no_leaks):
    """The troubleshooting page tells run() users to raise the placement timeout: run()
    had no such parameter, and a job too large waited out the executor's 100 s."""
    with pytest.raises(PlacementTimeoutError, match=r"placement_group_timeout_s=2s"):
        horovod_ray.run(os.getpid, num_slots=2, cpus_per_slot=3, placement_group_timeout_s=2)
    assert alive_actors() == []


def test_a_failed_job_restarts_and_resumes_from_its_checkpoint(ray_4cpu, no_leaks, tmp_path):
    results = horovod_ray.run(
        _resumes_from_its_checkpoint, args=(str(tmp_path),), num_slots=2, max_restarts=2
    )
    (attempt, start), second = results
    assert second == (attempt, start) and attempt == 1  # one restart, every rank in it
    assert start in (1, 2)  # from rank 0's last checkpoint, not from the beginning
    assert (tmp_path / "checkpoint").read_text() == "4"
    # One job to horovod-ray status, named by its function, with its restart counted.
    (job,) = [
        job for job in horovod_ray.jobs(all=True) if job.name == "_resumes_from_its_checkpoint"
    ]
    assert (job.state, job.restarts, job.ranks_wanted) == ("stopped", 1, 2)


def _reports_and_resumes() -> tuple[int, int]:
    """Reports a checkpoint each step; rank 1 dies in attempt 0 once two are reported.
    Returns (the attempt, the step it resumed from)."""
    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint, CheckpointUploadMode

    hvd.init()
    start = 0
    if (checkpoint := horovod_ray.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "step").read_text())
    for step in range(start, 4):
        hvd.allreduce(torch.tensor(1.0))
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(step + 1))
            # Committed when it returns: rank 1 dies only after rank 0's first one is.
            horovod_ray.report(
                {"step": step + 1},
                checkpoint=Checkpoint.from_directory(folder),
                checkpoint_upload_mode=CheckpointUploadMode.SYNC,
            )
        if step == 1 and horovod_ray.attempt() == 0 and hvd.rank() == 1:
            os._exit(3)
    return horovod_ray.attempt(), start


def test_ray_trains_config_objects_size_store_and_restart_the_job(ray_4cpu, no_leaks, tmp_path):
    """Asked for as a Ray Train user asks: two ranks, a run folder, two restarts; the
    restart resumes from the run folder's latest checkpoint."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    results = horovod_ray.run(
        _reports_and_resumes,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1.5}),
        run_config=RunConfig(
            name="from-ray",
            storage_path=str(tmp_path),
            failure_config=FailureConfig(max_failures=2),
        ),
    )
    (attempt, start), second = results
    assert second == (attempt, start) and attempt == 1
    assert start >= 1  # rank 0's first report at least was committed before rank 1 died
    assert horovod_ray.Result.from_path(str(tmp_path / "from-ray")).metrics["step"] == 4
    (job,) = [job for job in horovod_ray.jobs(all=True) if job.name == "from-ray"]
    assert (job.state, job.restarts, job.ranks_wanted) == ("stopped", 1, 2)


def test_a_spent_restart_budget_lists_every_attempt(ray_4cpu, no_leaks):
    def train():
        if os.environ["HOROVOD_RANK"] == "0":
            raise ValueError(f"bad batch in attempt {horovod_ray.attempt()}")

    with pytest.raises(WorkerFailedError) as info:
        horovod_ray.run(train, num_slots=2, max_restarts=1)
    assert_two_attempts_spent(info.value, rank=0)


BAD_RUN_CALLS = [
    ("run('not callable', num_slots=1)", "train_fn"),
    ("run(len, num_slots=0)", "num_slots"),
    ("run(len, num_hosts=0)", "num_hosts"),
    ("run(len, cpus_per_slot=-1)", "cpus_per_slot"),
    ("run(len, timeout_s=0)", "timeout_s"),
    ("run(len, nics=5)", "nics"),
    ("run(len, env={'A': [1]})", "env"),
    ("run(len, args=5)", "args"),
    ("run(len, kwargs=[1])", "kwargs"),
    ("run(len, callbacks=3)", "callbacks"),
    ("run(lambda: lock, num_slots=1)", "train_fn"),
    ("run(len, max_restarts=-1)", "max_restarts"),
    ("run(len, max_restarts=1.5)", "max_restarts"),
    ("run(len, min_workers=2, max_restarts=1)", "max_restarts"),
    # Ray Train's config objects: each wrong field named, and one beside its keywords.
    ("run(len, scaling_config={'num_workers': 2})", "scaling_config"),
    ("run(len, num_slots=2, scaling_config=ScalingConfig(num_workers=2))", "scaling_config"),
    ("run(len, local=True, scaling_config=ScalingConfig(num_workers=1))", "scaling_config"),
    ("run(len, scaling_config=ScalingConfig(placement_strategy='SPREAD'))",
     "scaling_config.placement_strategy"),
    ("run(len, scaling_config=ScalingConfig(resources_per_worker={'memory': 1}))",
     "scaling_config.resources_per_worker"),
    ("run(len, name='a', run_config=RunConfig(name='b'))", "run_config"),
    ("run(len, run_config=RunConfig(failure_config=FailureConfig(max_failures=-1)))",
     "run_config.failure_config.max_failures"),
    # The job settings as one object: not beside the keywords they hold.
    ("run(len, settings={'timeout_s': 5})", "settings"),
    ("run(len, timeout_s=5, settings=RayExecutor.create_settings())", "settings"),
    ("run(len, settings=RayExecutor.create_settings(name='a'), run_config=RunConfig(name='b'))",
     "run_config"),
]  # fmt: skip


def test_bad_input_is_refused_before_ray_starts():
    calls = "\n".join(
        f"try:\n    {call}\nexcept ConfigError as err:\n    print('PARAM', err.parameter)"
        for call, _ in BAD_RUN_CALLS
    )
    code = (
        "import threading, ray\n"
        "from horovod_ray import run, ConfigError, RayExecutor\n"
        "from ray.train import FailureConfig, RunConfig, ScalingConfig\n"
        "lock = threading.Lock()\n"
        f"{calls}\n"
        "print('RAY', ray.is_initialized())\n"
    )
    out = run_fresh_python(code, timeout_s=120).split("\n")
    assert [line.split()[1] for line in out if line.startswith("PARAM")] == [
        parameter for _, parameter in BAD_RUN_CALLS
    ]
    assert "RAY False" in out


# Prints each Ray process kind that ray's Node stops, and whether the autoscaler monitor
# was still running then; the stop itself goes on unchanged.
SPY_ON_RAY_STOP = (
    "from ray._private.node import Node\n"
    "_kill = Node._kill_process_type\n"
    "def _spy(node, kind, *args, **kwargs):\n"
    "    monitor = node.all_processes.get('monitor')  # dropped once stopped\n"
    "    running = monitor is not None and monitor[0].process.poll() is None\n"
    "    print('STOP', kind, 'monitor running:', running, flush=True)\n"
    "    _kill(node, kind, *args, **kwargs)\n"
    "Node._kill_process_type = _spy\n"
)


# Prints when Ray's exit hook takes its fixed sleep for the workers' last lines.
SPY_ON_RAY_SLEEP = (
    "import sys, time\n"
    "_sleep = time.sleep\n"
    "def _spy_sleep(seconds):\n"
    "    if sys._getframe(1).f_code.co_name == 'shutdown':\n"
    "        print('RAY SLEPT', seconds, flush=True)\n"
    "    _sleep(seconds)\n"
    "time.sleep = _spy_sleep\n"
)
LAST_LINES = 2000


def test_run_starts_a_local_ray_which_stops_at_exit_after_the_ranks_last_lines():
    code = (
        "import os\n"
        "os.environ['RAY_DEDUP_LOGS'] = '0'  # every line as printed\n"
        + SPY_ON_RAY_STOP
        + SPY_ON_RAY_SLEEP
        + "import ray, horovod_ray\n"
        "sys.stderr = sys.stdout  # the ranks' stderr lines too\n"
        # One write a line: print() writes its parts one by one, each flushed, and Ray's
        # log monitor may read between two of them and forward the line in two pieces.
        "def train():\n"
        "    rank = os.environ['HOROVOD_RANK']\n"
        f"    for i in range({LAST_LINES}):\n"
        "        sys.stdout.write(f'LINE {rank} {i}\\n')\n"
        "    sys.stderr.write(f'ERR {rank}\\n')\n"
        "    sys.stdout.write(f'LAST {rank}')  # no newline\n"
        "    return 7, os.nice(0)\n"
        # The same here: Ray's printer thread may still forward the ranks' last lines.
        "sys.stdout.write(f'RESULT {horovod_ray.run(train, num_slots=2)}\\n')\n"
        "sys.stdout.write(f'RAY {ray.is_initialized()}\\n')\n"
    )
    out = run_fresh_python(code, timeout_s=180)
    # The ranks run at niceness 0, as horovodrun's do (Ray's default for workers is 15).
    assert "RESULT [(7, 0), (7, 0)]" in out
    assert "RAY True" in out
    # Ray is stopped at exit, monitor first: stopped after the GCS, the monitor's SIGTERM
    # handler waits on the gone GCS until Ray kills it a second later.
    assert "STOP gcs_server monitor running: False" in out
    # Every line the ranks printed arrived before Ray stopped, without Ray's blind sleep
    # for them, and no marker of the wait shows.
    lines = re.findall(r"LINE (\d) (\d+)", out)
    assert sorted(lines) == sorted((r, str(i)) for r in "01" for i in range(LAST_LINES))
    for rank in "01":
        assert f"ERR {rank}" in out and f"LAST {rank}" in out
    assert "RAY SLEPT" not in out
    assert worker_output.MARKER not in out


def test_local_ray_stop_ends_the_monitor_before_the_gcs():
    code = SPY_ON_RAY_STOP + (
        "import ray\n"
        "from horovod_ray import local_ray\n"
        "local_ray.start(num_cpus=1)\n"
        "local_ray.stop()\n"
        "print('RAY', ray.is_initialized())\n"
    )
    out = run_fresh_python(code, timeout_s=180)
    assert "STOP gcs_server monitor running: False" in out
    assert "RAY False" in out


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        horovod_ray.run(len, num_slots=0)
    assert isinstance(ConfigError("x", "y"), ValueError)


@pytest.mark.unit
def test_job_settings_given_as_one_object_name_and_store_the_run(tmp_path):
    """As RayExecutor takes them; run here (local=True: no Ray) to see them reach the run."""
    from ray.train import Checkpoint

    def train():
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text("1")
            horovod_ray.report({"step": 1}, checkpoint=Checkpoint.from_directory(folder))
        return horovod_ray.get_context().get_experiment_name()

    settings = horovod_ray.RayExecutor.create_settings(name="one", storage_path=str(tmp_path))
    assert horovod_ray.run(train, local=True, settings=settings) == ["one"]
    assert horovod_ray.Result.from_path(str(tmp_path / "one")).metrics["step"] == 1
