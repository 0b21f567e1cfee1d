"""The Tune adapter on real Tune runs: every trial a real 2-rank Horovod job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from horovod_ray import ConfigError, RayExecutor
from horovod_ray.settings import STALL_SHUTDOWN_ENV
from horovod_ray.tune import DistributedTrainableCreator
from test import checkpointed_training
from test.conftest import alive_actors, live_placement_groups, wait_until

pytestmark = pytest.mark.timeout(300)


def _hvd():
    import horovod.torch as hvd

    hvd.init()
    return hvd


def report_ranks(config):
    """Three reports per rank; each rank says who it is, rank 0 also when it ran."""
    import torch

    import horovod_ray

    hvd = _hvd()
    context = horovod_ray.get_context()
    started = time.time()
    for step in range(3):
        total = float(hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum))
        time.sleep(config.get("sleep_s", 0))
        tune.report(
            {
                "reporting_rank": hvd.rank(),
                "context": [context.get_world_rank(), context.get_world_size()],
                "context_trial": context.get_trial_id(),
                "context_experiment": context.get_experiment_name(),
                "size": hvd.size(),
                "sum": total,
                "step": step,
                "started": started,
                "ended": time.time(),
            }
        )


def test_resource_request_is_one_bundle_per_host_and_an_empty_head():
    trainable = DistributedTrainableCreator(report_ranks, num_hosts=1, num_slots=2)
    request = trainable.default_resource_request({})
    assert request.head_bundle_is_empty
    assert request.bundles == [{"CPU": 2.0}]
    assert request.strategy == "PACK"
    spread = DistributedTrainableCreator(
        report_ranks, num_hosts=3, num_slots=2, num_cpus_per_slot=0.5
    ).default_resource_request({})
    assert spread.bundles == [{"CPU": 1.0}] * 3
    assert spread.strategy == "STRICT_SPREAD"
    assert issubclass(trainable, tune.Trainable)


def test_rank_zero_metrics_and_two_trials_at_a_time_on_four_cpus(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(report_ranks, num_hosts=1, num_slots=2)
    tuner = tune.Tuner(
        trainable,
        param_space={"sleep_s": 1.0},
        # Reused actors, as the docs advise: the second pair of trials on warm ranks.
        tune_config=tune.TuneConfig(num_samples=4, reuse_actors=True),
        run_config=tune.RunConfig(name="ranks", storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert results.num_errors == 0
    frame = results.get_dataframe()
    assert list(frame["reporting_rank"]) == [0, 0, 0, 0]
    assert list(frame["training_iteration"]) == [3, 3, 3, 3]
    assert set(frame["size"]) == {2} and set(frame["sum"]) == {3.0}
    # horovod_ray.get_context() on a trial's rank: the rank's numbers and the trial's facts.
    assert [list(c) for c in frame["context"]] == [[0, 2]] * 4
    assert list(frame["context_trial"]) == list(frame["trial_id"])
    assert set(frame["context_experiment"]) == {"ranks"}
    # The trials' busy intervals: never three at once, and pairs did overlap.
    spans = list(zip(frame["started"], frame["ended"], strict=True))
    overlaps = [sum(start <= t < end for start, end in spans) for t, _ in spans]
    assert max(overlaps) == 2
    assert wait_until(lambda: alive_actors() == [])
    assert wait_until(lambda: live_placement_groups() == [])


def decreasing_loss(config):
    import torch

    hvd = _hvd()
    pids = ",".join(map(str, hvd.allgather_object(os.getpid())))
    for step in range(1, 7):
        loss = config["scale"] / step
        loss = float(hvd.allreduce(torch.tensor(loss)))  # the ranks agree on it
        tune.report({"loss": loss, "pids": pids})


def test_asha_stops_trials_early_and_releases_their_workers(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(decreasing_loss, num_hosts=1, num_slots=2)
    tuner = tune.Tuner(
        trainable,
        param_space={"scale": tune.grid_search([1.0, 2.0, 4.0, 8.0])},
        tune_config=tune.TuneConfig(
            metric="loss",
            mode="min",
            scheduler=ASHAScheduler(max_t=6, grace_period=1, reduction_factor=2),
        ),
        run_config=tune.RunConfig(name="asha", storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert results.num_errors == 0
    iterations = sorted(results.get_dataframe()["training_iteration"])
    assert iterations[0] < 6  # some trial was stopped early
    assert iterations[-1] == 6
    assert results.get_best_result().config["scale"] == 1.0
    # Without actor reuse (Tune's default) every trial gets new ranks, also the ones that
    # start after others ended.
    ranks = [set(pids.split(",")) for pids in results.get_dataframe()["pids"]]
    assert len(set().union(*ranks)) == 2 * len(ranks) == 8
    assert wait_until(lambda: alive_actors() == [])
    assert wait_until(lambda: live_placement_groups() == [])


def checkpointed_sum(config):
    """A deterministic 'training': state += allreduce(rank + step) each step."""
    import json
    import tempfile

    import torch

    hvd = _hvd()
    state, start = 0.0, 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, "state.json")) as handle:
                saved = json.load(handle)
        state, start = saved["state"], saved["step"]
    # Every rank says which step it resumed from; rank 0 reports them all.
    resumed = hvd.allgather(torch.tensor([start])).numpy().tolist()
    for step in range(start, config["steps"]):
        state += float(hvd.allreduce(torch.tensor(float(hvd.rank() + step)), op=hvd.Sum))
        time.sleep(config.get("step_s", 0))
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "state.json"), "w") as handle:
                json.dump({"state": state, "step": step + 1}, handle)
            tune.report(
                {"state": state, "step": step + 1, "resumed_from": resumed},
                checkpoint=tune.Checkpoint.from_directory(directory),
            )


def test_horovod_rays_report_and_get_checkpoint_go_to_the_trial(ray_4cpu, tmp_path):
    """The function test_checkpoints runs with run(), RayExecutor and the command line,
    unchanged: its horovod_ray.report / get_checkpoint are Tune's in a trial."""
    trainable = DistributedTrainableCreator(
        checkpointed_training.checkpointed_sum, num_hosts=1, num_slots=2
    )
    tuner = tune.Tuner(
        trainable,
        param_space={"steps": 6, "die_at": 3},
        run_config=tune.RunConfig(
            name="horovod_ray_report",
            storage_path=str(tmp_path),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    )
    results = tuner.fit()
    assert results.num_errors == 0
    result = results[0]
    assert result.metrics["state"] == checkpointed_training.expected_state(6)
    assert result.metrics["resumed_from"] == [3, 3]  # Tune restored step 3 on both ranks
    assert result.checkpoint is not None  # Tune holds the checkpoints, not horovod_ray
    assert wait_until(lambda: alive_actors() == [])


def test_a_worker_failure_fails_the_trial_with_the_rank(ray_4cpu, tmp_path):
    def broken(config):
        hvd = _hvd()
        if hvd.rank() == 1:
            raise RuntimeError("rank one cannot read its shard")
        tune.report({"ok": 1})

    trainable = DistributedTrainableCreator(broken, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        run_config=tune.RunConfig(name="broken", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert results.num_errors == 1
    error = str(results.errors[0])
    assert "WorkerFailedError" in error and "rank 1" in error
    assert "rank one cannot read its shard" in error
    assert wait_until(lambda: alive_actors() == [])


def _two_args(config, extra):
    pass


SETTINGS = RayExecutor.create_settings(timeout_s=30)


def _storing_settings():
    import tempfile

    return RayExecutor.create_settings(storage_path=tempfile.gettempdir(), name="trials")


def report_job_settings(config):
    """What the trial's job told its ranks: its name, Gloo's timeout, the stall's."""
    _hvd()
    keys = ("HOROVOD_RAY_JOB_NAME", "HOROVOD_GLOO_TIMEOUT_SECONDS", STALL_SHUTDOWN_ENV)
    tune.report({key: os.environ.get(key) for key in keys})


def test_a_trials_job_takes_the_settings_run_takes(ray_4cpu, tmp_path):
    settings = RayExecutor.create_settings(timeout_s=45, stall_timeout_s=70, name="tuned")
    trainable = DistributedTrainableCreator(report_job_settings, num_slots=2, settings=settings)
    tuner = tune.Tuner(
        trainable,
        run_config=tune.RunConfig(name="settings", storage_path=str(tmp_path), verbose=0),
    )
    (result,) = tuner.fit()
    assert result.error is None
    keys = ("HOROVOD_RAY_JOB_NAME", "HOROVOD_GLOO_TIMEOUT_SECONDS", STALL_SHUTDOWN_ENV)
    assert [result.metrics[key] for key in keys] == ["tuned", "45", "70"]
    assert wait_until(lambda: alive_actors() == [])


def _no_args():
    pass


@pytest.mark.parametrize(
    "func,kwargs,parameter",
    [
        (report_ranks, {"num_hosts": 0}, "num_hosts"),
        (report_ranks, {"num_slots": 0}, "num_slots"),
        (report_ranks, {"num_slots": 1.5}, "num_slots"),
        (report_ranks, {"num_cpus_per_slot": 0}, "num_cpus_per_slot"),
        (report_ranks, {"use_gpu": "no"}, "use_gpu"),
        (report_ranks, {"timeout_s": -1}, "timeout_s"),
        (report_ranks, {"settings": {"nics": ["lo"]}}, "settings"),
        (report_ranks, {"settings": SETTINGS, "timeout_s": 30}, "timeout_s"),
        (report_ranks, {"settings": _storing_settings()}, "settings"),
        (report_ranks, {"settings": RayExecutor.create_settings(timeline="t.json")}, "settings"),
        ("report_ranks", {}, "func"),
        (_two_args, {}, "func"),
        (_no_args, {}, "func"),
    ],
)
def test_bad_input_is_refused_at_creation(func, kwargs, parameter):
    with pytest.raises(ConfigError) as info:
        DistributedTrainableCreator(func, **kwargs)
    assert info.value.parameter == parameter


def test_legacy_tune_run_still_works(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(report_ranks, num_hosts=1, num_slots=2)
    analysis = tune.run(trainable, config={}, storage_path=str(tmp_path), verbose=0)
    result = analysis.trials[0].last_result
    assert (result["reporting_rank"], result["sum"], result["training_iteration"]) == (0, 3.0, 3)


def rank_pids(config):
    """One report: every rank's pid, and an allreduce of the trial's x."""
    import torch

    hvd = _hvd()
    total = float(hvd.allreduce(torch.tensor(float(config["x"])), op=hvd.Sum))
    pids = hvd.allgather_object(os.getpid())
    tune.report({"pids": ",".join(map(str, pids)), "sum": total})
    if config.get("shutdown"):
        hvd.shutdown()  # the next trial on these ranks must join Horovod again


def _trial_pids(results) -> list[str]:
    frame = results.get_dataframe().sort_values("config/x")
    return list(frame["pids"])


def test_reused_actors_run_the_next_trials_on_the_same_warm_ranks(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(rank_pids, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        param_space={
            "x": tune.grid_search([1, 2, 3, 4]),
            "shutdown": tune.sample_from(lambda spec: spec.config.x == 2),
        },
        tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=1),
        run_config=tune.RunConfig(name="warm", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert results.num_errors == 0
    frame = results.get_dataframe().sort_values("config/x")
    assert list(frame["sum"]) == [2.0, 4.0, 6.0, 8.0]  # each trial's own config, 2 ranks
    pids = _trial_pids(results)
    assert len(set(pids[0].split(","))) == 2
    # One pair of rank processes served all four trials, also after an hvd.shutdown().
    assert set(pids) == {pids[0]}
    assert wait_until(lambda: alive_actors() == [])
    assert wait_until(lambda: live_placement_groups() == [])


class _KillRankOne(tune.Callback):
    """Kills rank 1 of each finished trial: its job is then warm, idle, and broken."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        os.kill(int(trial.last_result["pids"].split(",")[1]), signal.SIGKILL)


def test_a_warm_job_that_lost_a_rank_is_replaced_before_the_next_trial(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(rank_pids, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        param_space={"x": tune.grid_search([1, 2])},
        tune_config=tune.TuneConfig(reuse_actors=True, max_concurrent_trials=1),
        run_config=tune.RunConfig(
            name="broken-warm", storage_path=str(tmp_path), verbose=0, callbacks=[_KillRankOne()]
        ),
    ).fit()
    assert results.num_errors == 0
    first, second = (p.split(",") for p in _trial_pids(results))
    assert first[1] != second[1]  # the killed rank was not reused
    assert wait_until(lambda: alive_actors() == [])


def test_ranks_session_is_what_ray_tune_reads(tmp_path):
    """Fails loudly if a Ray upgrade moves the session Tune's functions look up."""
    from horovod_ray.tune import parcels
    from horovod_ray.tune import session as rank_session

    (tmp_path / "weights.txt").write_text("w=3")
    packed = parcels.pack_checkpoint(tune.Checkpoint.from_directory(str(tmp_path)))
    session = rank_session.TrialSession(0, packed, rank_session.TrialFacts(trial_name="t0"))
    rank_session.install_session(session)
    try:
        restored = tune.get_checkpoint()
        assert restored is not None
        with restored.as_directory() as directory:
            assert (Path(directory) / "weights.txt").read_text() == "w=3"
    finally:
        rank_session.install_session(None)
        session.close()
    assert tune.get_checkpoint() is None


def test_a_checkpoint_with_a_link_to_a_folder_it_is_in_is_refused(tmp_path):
    """tarfile followed the link without end (a RecursionError, or a name too long, after
    building an archive in memory)."""
    from horovod_ray.errors import CheckpointError
    from horovod_ray.tune import parcels

    (tmp_path / "model" / "layers").mkdir(parents=True)
    (tmp_path / "model" / "layers" / "w.bin").write_text("w")
    (tmp_path / "model" / "layers" / "up").symlink_to(tmp_path / "model")
    with pytest.raises(CheckpointError, match=r"layers/up is a link to a folder it is in"):
        parcels.pack_checkpoint(tune.Checkpoint.from_directory(str(tmp_path)))


def test_a_trial_jobs_copies_are_removed_once_and_never_while_its_ranks_may_run(monkeypatch):
    """cleanup() and the trial's thread may both stop a job (each removal asks every
    node); a stop that timed out leaves ranks that may still read their copies."""
    import types

    from horovod_ray import ExecutorState
    from horovod_ray.tune import trainable

    removals: list[str] = []
    monkeypatch.setattr(
        trainable, "remove_restored_copies", lambda tag, nodes: removals.append(tag)
    )
    executor = types.SimpleNamespace(state=ExecutorState.STOPPING, stop=lambda: None)
    job = trainable._Job(executor)
    job.stop()  # not released yet
    assert removals == []
    executor.state = ExecutorState.STOPPED
    job.stop()
    job.stop()
    assert removals == [job.copies_tag]


def _restore_and_wait(config):
    """A trial function that restores its checkpoint, says where the copy is, and trains
    on until it is stopped."""
    checkpoint = tune.get_checkpoint()
    Path(config["out"], f"copy-{os.environ['HOROVOD_RANK']}").write_text(checkpoint.path)
    time.sleep(120)


def test_a_stopped_trials_restored_copies_are_removed_by_the_next_trial(ray_4cpu, tmp_path):
    """A trial stopped by a stopper or a scheduler has its ranks killed without grace, so
    their copies of the restored checkpoint stayed on disk, one set per restore."""
    from horovod_ray import RayExecutor
    from horovod_ray.tune import parcels
    from horovod_ray.tune import session as rank_session

    (tmp_path / "weights.txt").write_text("w=3")
    packed = parcels.pack_checkpoint(tune.Checkpoint.from_directory(str(tmp_path)))
    settings = RayExecutor.create_settings(timeout_s=60)
    stopped = RayExecutor(settings, num_workers=2)
    stopped.start()
    try:
        stopped.run_remote(
            rank_session.rank_main,
            args=[_restore_and_wait, {"out": str(tmp_path)}, packed, rank_session.TrialFacts()],
        )
        outs = [tmp_path / "copy-0", tmp_path / "copy-1"]
        assert wait_until(lambda: all(p.exists() for p in outs), timeout_s=60)
        copies = [Path(p.read_text()) for p in outs]
        assert all((copy / "weights.txt").exists() for copy in copies)
    finally:
        stopped.stop()  # as Tune's cleanup() does: the ranks are killed mid-trial
    assert all(copy.exists() for copy in copies)  # nothing could remove them then
    with RayExecutor(settings, num_workers=2) as next_trial:
        next_trial.run(
            rank_session.rank_main, args=[lambda config: None, {}, None, rank_session.TrialFacts()]
        )
    assert not any(copy.exists() for copy in copies)


def test_only_copies_of_processes_that_are_gone_are_swept(tmp_path):
    from horovod_ray.tune.session import FORWARDED_PREFIX, RESTORED_PREFIX, sweep_stale

    gone = _dead_pid()
    names = [
        f"{RESTORED_PREFIX}{gone}-abc",
        f"{FORWARDED_PREFIX}{gone}-def",
        f"{RESTORED_PREFIX}{os.getpid()}-ghi",  # this process: still in use
        f"other-{gone}-jkl",
    ]
    for name in names:
        (tmp_path / name).mkdir()
    assert sorted(sweep_stale(str(tmp_path))) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _our_copies() -> set[str]:
    """The checkpoint copies (restored on a rank, on their way to Tune) in the temporary
    folder now."""
    from horovod_ray.tune.session import FORWARDED_PREFIX, RESTORED_PREFIX

    return {
        name
        for name in os.listdir(tempfile.gettempdir())
        if name.startswith((RESTORED_PREFIX, FORWARDED_PREFIX))
    }


def _copy_pid(name: str) -> int:
    from horovod_ray.tune.session import FORWARDED_PREFIX, RESTORED_PREFIX

    prefix = RESTORED_PREFIX if name.startswith(RESTORED_PREFIX) else FORWARDED_PREFIX
    return int(name[len(prefix) :].split("-", 1)[0])


def _context_facts() -> dict:
    """What ``ray.tune.get_context()`` says here, as JSON."""
    import warnings

    context = tune.get_context()
    storage = context.get_storage()
    resources = context.get_trial_resources()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Tune deprecates the rank methods
        ranks = [
            context.get_world_size(),
            context.get_world_rank(),
            context.get_local_rank(),
            context.get_local_world_size(),
            context.get_node_rank(),
        ]
    return {
        "trial_name": context.get_trial_name(),
        "trial_id": context.get_trial_id(),
        "trial_resources": [resources.bundles, resources.strategy],
        "trial_dir": context.get_trial_dir(),
        "experiment_name": context.get_experiment_name(),
        "storage": [
            storage.storage_fs_path,
            storage.experiment_fs_path,
            storage.trial_fs_path,
            storage.trial_driver_staging_path,
        ],
        "ranks": ranks,
    }


def _recording(trainable: type) -> type:
    """``trainable``, whose actor writes its pid and its own Tune context to
    ``config["out"]`` as each trial starts there."""

    class Recording(trainable):
        def setup(self, config):
            super().setup(config)
            out = Path(config["out"])
            (out / "pids").mkdir(exist_ok=True)
            (out / "pids" / str(os.getpid())).touch()
            facts = _context_facts()
            (out / f"actor-{facts['trial_id']}.json").write_text(json.dumps(facts))

    return Recording


def fast_large_checkpoints(config):
    """Rank 0 reports 4 MB checkpoints as fast as it can and writes, after each report()
    returns, whether that checkpoint was in the trial's storage by then."""
    import tempfile

    hvd = _hvd()
    storage = Path(config["storage"])
    for k in range(config["reports"]):
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "blob.bin").write_bytes(os.urandom(4 << 20))
            tune.report({"k": k}, checkpoint=tune.Checkpoint.from_directory(directory))
        if hvd.rank() == 0:
            persisted = any(storage.glob(f"*/*/checkpoint_{k:06d}/blob.bin"))
            with open(config["out"], "a") as out:
                out.write(f"{k} {int(persisted)}\n")


def test_report_returns_once_tune_has_the_checkpoint(ray_4cpu, tmp_path):
    """Reports wait as Ray's own do: rank 0 holds one checkpoint at a time, and one that
    report() returned from is in the trial's storage, also when Tune stops the trial."""
    out = tmp_path / "returned.txt"
    storage = tmp_path / "storage"
    trainable = DistributedTrainableCreator(fast_large_checkpoints, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        param_space={"reports": 8, "storage": str(storage), "out": str(out)},
        run_config=tune.RunConfig(
            name="backpressure",
            storage_path=str(storage),
            verbose=0,
            stop={"training_iteration": 3},
        ),
    ).fit()
    assert results.num_errors == 0
    assert results[0].metrics["training_iteration"] == 3
    returned = [line.split() for line in out.read_text().splitlines()]
    assert returned, "no report() returned"
    # Every report() that returned had its checkpoint persisted; none ran ahead of Tune.
    assert returned == [[str(k), "1"] for k in range(len(returned))]
    assert len(returned) <= 4
    assert wait_until(lambda: alive_actors() == [])


def context_on_ranks(config):
    hvd = _hvd()
    Path(config["out"], f"rank-{hvd.rank()}.json").write_text(json.dumps(_context_facts()))
    tune.report({"ok": 1})


def test_ranks_see_the_trials_tune_context(ray_4cpu, tmp_path):
    trainable = _recording(DistributedTrainableCreator(context_on_ranks, num_slots=2))
    results = tune.Tuner(
        trainable,
        param_space={"out": str(tmp_path)},
        run_config=tune.RunConfig(name="context", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert results.num_errors == 0, results.errors
    (actor,) = tmp_path.glob("actor-*.json")
    expected = json.loads(actor.read_text())
    assert expected["trial_id"] == results[0].metrics["trial_id"]
    assert expected["storage"][2] == results[0].path
    assert expected["experiment_name"] == "context"
    assert expected["trial_name"] and expected["trial_dir"]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == expected
    assert wait_until(lambda: alive_actors() == [])


def _linked_folder(root: Path) -> Path:
    """A folder laid out as Hugging Face's cache: its files are links to blobs outside
    it, one relative, one absolute, one to a folder."""
    (root / "blobs" / "tokenizer").mkdir(parents=True)
    (root / "blobs" / "abc123").write_text("weights")
    (root / "blobs" / "tokenizer" / "vocab.txt").write_text("vocab")
    snapshot = root / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.bin").symlink_to("../../blobs/abc123")
    (snapshot / "config.json").symlink_to(root / "blobs" / "abc123")
    (snapshot / "tokenizer").symlink_to(root / "blobs" / "tokenizer")
    return snapshot


def _read_linked(directory: str) -> list[str]:
    folder = Path(directory)
    return [
        (folder / "model.bin").read_text(),
        (folder / "config.json").read_text(),
        (folder / "tokenizer" / "vocab.txt").read_text(),
    ]


def linked_checkpoint(config):
    """Rank 0 reports a checkpoint of links out of its folder; rank 1 dies once after it.
    Restored, every rank reads the files."""
    import torch

    hvd = _hvd()
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        folder = _linked_folder(Path(config["out"], f"cache-{os.getpid()}"))
        tune.report({"restored": ""}, checkpoint=tune.Checkpoint.from_directory(str(folder)))
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(torch.tensor(1.0))  # fails on rank 0: the trial restores
        return
    with checkpoint.as_directory() as directory:
        read = _read_linked(directory)
    tune.report({"restored": json.dumps(hvd.allgather_object(read))})


def test_a_checkpoint_of_links_out_of_its_folder_is_reported_and_restored(ray_4cpu, tmp_path):
    trainable = DistributedTrainableCreator(linked_checkpoint, num_slots=2)
    results = tune.Tuner(
        trainable,
        param_space={"out": str(tmp_path)},
        run_config=tune.RunConfig(
            name="links",
            storage_path=str(tmp_path),
            verbose=0,
            failure_config=tune.FailureConfig(max_failures=1),
        ),
    ).fit()
    assert results.num_errors == 0, results.errors
    restored = json.loads(results[0].metrics["restored"])
    assert restored == [["weights", "weights", "vocab"]] * 2
    assert wait_until(lambda: alive_actors() == [])


def _read_restored(config):
    checkpoint = tune.get_checkpoint()
    with checkpoint.as_directory() as directory:
        read = _read_linked(directory)
    Path(config["out"], f"rank-{os.environ['HOROVOD_RANK']}.json").write_text(json.dumps(read))


def test_a_restored_checkpoint_of_links_out_of_its_folder_reaches_every_rank(ray_4cpu, tmp_path):
    """The trial's restored checkpoint goes to the ranks as rank 0's goes to the trial:
    links out of the folder are followed (as the storage path's copy does)."""
    from horovod_ray import RayExecutor
    from horovod_ray.tune import parcels
    from horovod_ray.tune import session as rank_session

    folder = _linked_folder(tmp_path / "cache")
    packed = parcels.pack_checkpoint(tune.Checkpoint.from_directory(str(folder)))
    settings = RayExecutor.create_settings(timeout_s=60)
    with RayExecutor(settings, num_workers=2) as executor:
        executor.run(
            rank_session.rank_main,
            args=[_read_restored, {"out": str(tmp_path)}, packed, rank_session.TrialFacts()],
        )
    for rank in (0, 1):
        read = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert read == ["weights", "weights", "vocab"]


def slow_checkpointed_sum(config):
    """checkpointed_sum, a step every 0.3 s; each rank writes its pid to
    ``config["out"]/pids``."""
    Path(config["out"], "pids", str(os.getpid())).touch()
    checkpointed_sum({**config, "step_s": 0.3})


def test_pbt_restores_every_rank_and_no_checkpoint_copies_are_left_when_fit_returns(
    ray_4cpu, tmp_path
):
    """PBT pauses the lower of two trials and restores it from the other's checkpoint on
    every rank (actors reused); both are then stopped mid-training, their ranks killed
    while they hold their restored copies, and no later trial starts: fit() returns with
    none left."""
    from ray.tune.schedulers import PopulationBasedTraining

    before = _our_copies()
    (tmp_path / "pids").mkdir()
    trainable = _recording(DistributedTrainableCreator(slow_checkpointed_sum, num_slots=2))
    scheduler = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"unused": [1, 2]},
        quantile_fraction=0.5,  # of two trials, the lower one is exploited
        synch=True,  # at every interval, so that it happens for certain
        metric="state",
        mode="max",
    )
    results = tune.Tuner(
        trainable,
        param_space={"steps": 6, "unused": tune.choice([1, 2]), "out": str(tmp_path)},
        tune_config=tune.TuneConfig(num_samples=2, scheduler=scheduler, reuse_actors=True),
        run_config=tune.RunConfig(
            name="pbt", storage_path=str(tmp_path), verbose=0, stop={"training_iteration": 4}
        ),
    ).fit()
    assert results.num_errors == 0, results.errors
    resumed = []
    for result in results:
        # Restored or not, a trial's state is an uninterrupted run's at its step, and
        # the ranks of a restored trial agree on the step they resumed from.
        metrics = result.metrics
        assert metrics["state"] == checkpointed_training.expected_state(metrics["step"])
        first, second = metrics["resumed_from"]
        assert first == second
        resumed.append(first)
    assert max(resumed) > 0  # a trial was paused and restored from a checkpoint
    ours = {int(p.name) for p in (tmp_path / "pids").iterdir()}
    left = {name for name in _our_copies() - before if _copy_pid(name) in ours}
    assert left == set()
    assert wait_until(lambda: alive_actors() == [])
    assert wait_until(lambda: live_placement_groups() == [])


def _many_checkpoints(config):
    """Rank 0 reports an 8 MiB checkpoint each step, as fast as it can; it records its
    memory (private and shared pages: the object store's count too) after 5 and after
    ``steps`` reports."""
    import numpy as np

    hvd = _hvd()
    memory = {}
    for step in range(1, config["steps"] + 1):
        with tempfile.TemporaryDirectory() as folder:
            np.save(os.path.join(folder, "weights.npy"), np.full(1 << 20, float(step)))
            tune.report(
                {"step": step, "memory_mib": dict(memory)},
                checkpoint=tune.Checkpoint.from_directory(folder),
            )
        if step in (5, config["steps"] - 1) and hvd.rank() == 0:
            memory[step] = _rss_mib()


def _rss_mib() -> float:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return sum(int(fields[name].split()[0]) for name in ("RssAnon", "RssShmem")) / 1024


def test_a_trials_checkpoints_do_not_pile_up_in_rank_0s_memory(ray_4cpu, tmp_path):
    """Sent through rank 0's log channel as bytes, 40 reports of an 8 MiB checkpoint grew
    rank 0 by 161 MiB (56 after 5, 153 after 20); Tune's own function trainable doing the
    same grows by 1. Now each goes as a file on rank 0's node."""
    import numpy as np

    steps = 30
    trainable = DistributedTrainableCreator(_many_checkpoints, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        param_space={"steps": steps},
        run_config=tune.RunConfig(name="heavy", storage_path=str(tmp_path), verbose=0),
    ).fit()
    (result,) = results
    assert result.error is None
    assert result.metrics["step"] == steps
    with result.checkpoint.as_directory() as folder:
        assert np.load(os.path.join(folder, "weights.npy"))[0] == steps
    memory = {int(step): mib for step, mib in result.metrics["memory_mib"].items()}
    grown = memory[steps - 1] - memory[5]
    assert grown < 3 * 8, memory  # at most a few checkpoints' worth, whatever the count
