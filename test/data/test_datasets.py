"""Ray Data feeding a job: ``datasets=`` split over the ranks as Ray Train splits them,
equal rows per rank so that no rank's last allreduce waits for one that has stopped, the
split released with the job whatever ends it, bad input refused before anything starts."""

from __future__ import annotations

import re
import time

import pytest
import ray
import ray.train
from ray.util import state as ray_state

import horovod_ray
from horovod_ray import ConfigError, RayExecutor, WorkerFailedError
from horovod_ray.data.budget import RankReservation
from test.conftest import alive_actors, all_actors, ctrl_c_once, start_local_ray, wait_until
from test.data.ray_data import reserved_cpus

ROWS = 1001  # odd: two ranks cannot split it evenly
BATCH = 64


@pytest.fixture(scope="module", autouse=True)
def ray_with_room_for_data():
    """Two ranks' CPUs and two for Ray Data; Ray Data's own singleton actors (its stats,
    its autoscaling coordinator) made first, so that what a test leaves is the test's."""
    start_local_ray(4)
    ray.data.range(2).take_all()
    RankReservation({"CPU": 1.0}, 1).close()


def _coordinators() -> list:
    """Ray Data's actors of the splits that are not dead (being made, or alive)."""
    return [a for a in all_actors() if a.class_name == "SplitCoordinator" and a.state != "DEAD"]


def _no_coordinator_left() -> bool:
    """No split's coordinator is left, and each one ended was ended by the job
    (``ray.kill``), not by Ray once nothing referred to it any more."""
    if not wait_until(lambda: not _coordinators(), timeout_s=20):
        return False
    ended = ray_state.list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", "SplitCoordinator")],
        detail=True, limit=10_000, raise_on_missing_output=False,
    )  # fmt: skip
    causes = {
        ((a.death_cause or {}).get("actor_died_error_context") or {}).get("reason") for a in ended
    }
    assert causes <= {"RAY_KILL"}, causes
    return True


def train_epochs(epochs: int):
    import horovod.torch as hvd
    import torch

    from horovod_ray.rank import datasets

    hvd.init()
    shard = horovod_ray.get_dataset_shard("train")
    assert horovod_ray.get_dataset_shard("train") is shard  # one iterator per rank
    seen, steps = [], 0
    for _ in range(epochs):
        rows = []
        for batch in shard.iter_torch_batches(batch_size=BATCH):
            rows.extend(batch["id"].tolist())
            # A step's allreduce: a rank with a step more than the others would wait here.
            hvd.allreduce(torch.tensor(1.0), name="step")
            steps += 1
        seen.append(rows)
    whole = [int(i) for b in horovod_ray.get_dataset_shard("valid").iter_batches() for i in b["id"]]
    return {"rank": hvd.rank(), "steps": steps, "seen": seen, "valid": whole,
            "waited": datasets.waited_s()}  # fmt: skip


def test_every_rank_takes_as_many_rows_and_steps_and_no_row_twice():
    results = horovod_ray.run(
        train_epochs,
        args=[2],
        num_slots=2,
        datasets={"train": ray.data.range(ROWS), "valid": ray.data.range(30)},
        data_config=ray.train.DataConfig(datasets_to_split=["train"]),
    )
    assert [r["rank"] for r in results] == [0, 1]
    per_rank = ROWS // 2
    for epoch in range(2):
        parts = [r["seen"][epoch] for r in results]
        assert [len(p) for p in parts] == [per_rank, per_rank]  # the remainder: one row
        together = parts[0] + parts[1]
        assert len(set(together)) == len(together) == ROWS - 1
        assert set(together) <= set(range(ROWS))
    steps = 2 * -(-per_rank // BATCH)
    assert [r["steps"] for r in results] == [steps, steps]
    # A dataset left out of the split comes whole to every rank.
    assert [sorted(r["valid"]) for r in results] == [list(range(30))] * 2
    # Each rank counted its waits for data, by dataset.
    for r in results:
        assert set(r["waited"]) == {"train", "valid"} and r["waited"]["train"] > 0
    assert _no_coordinator_left()


def test_the_split_goes_with_a_job_that_failed():
    def fail_after_a_batch():
        import horovod.torch as hvd

        hvd.init()
        next(iter(horovod_ray.get_dataset_shard("train").iter_batches(batch_size=8)))
        if hvd.rank() == 1:
            raise RuntimeError("rank 1 fails mid-epoch")
        return hvd.rank()

    with pytest.raises(WorkerFailedError, match="rank 1 fails mid-epoch"):
        horovod_ray.run(fail_after_a_batch, num_slots=2, datasets={"train": ray.data.range(400)})
    assert _no_coordinator_left()


def read_then_wait():
    import time

    import horovod.torch as hvd

    hvd.init()
    next(iter(horovod_ray.get_dataset_shard("train").iter_batches(batch_size=8)))
    horovod_ray.log({"read": True})  # the driver's callback: Ctrl-C now
    time.sleep(60)


def test_ctrl_c_in_the_driver_releases_the_split():
    with ctrl_c_once() as (interrupt_once, interrupted):
        with pytest.raises(KeyboardInterrupt):
            horovod_ray.run(
                read_then_wait, num_slots=2, datasets={"train": ray.data.range(400)},
                callbacks=[interrupt_once],
            )  # fmt: skip
            time.sleep(30)  # only reached if run() returned; the interrupt then lands here
    assert interrupted.is_set()
    assert _no_coordinator_left()


def test_an_executor_splits_once_and_each_run_reads_an_epoch(no_leaks):
    def one_epoch():
        import horovod.torch as hvd

        hvd.init()
        shard = horovod_ray.get_dataset_shard("train")
        return sorted(int(i) for b in shard.iter_batches(batch_size=10) for i in b["id"])

    executor = RayExecutor(num_workers=2, datasets={"train": ray.data.range(100)})
    executor.start()
    requester = executor._now.sides._feed._reservation.requester_id
    try:
        assert wait_until(lambda: len(_coordinators()) == 1)
        assert reserved_cpus(requester) == 2  # the ranks' CPUs, kept from Ray Data
        for _ in range(2):
            first, second = executor.run(one_epoch)
            assert len(first) == len(second) == 50
            assert sorted(first + second) == list(range(100))
    finally:
        executor.stop()
    assert _no_coordinator_left()
    assert reserved_cpus(requester) == 0  # taken out with the job


def test_a_rank_asking_for_a_dataset_it_was_not_given_is_told_which_it_has():
    def ask(name):
        try:
            horovod_ray.get_dataset_shard(name)
        except KeyError as err:
            return str(err)

    (named,) = horovod_ray.run(ask, args=["training"], datasets={"train": ray.data.range(4)})
    assert "['train']" in named and "training" in named
    (none,) = horovod_ray.run(ask, args=["train"])
    assert "no datasets" in none and "datasets=" in none


def test_a_local_run_reads_the_whole_dataset():
    def read_all():
        shard = horovod_ray.get_dataset_shard("train")
        return sorted(int(i) for b in shard.iter_batches(batch_size=100) for i in b["id"])

    (rows,) = horovod_ray.run(read_all, local=True, datasets={"train": ray.data.range(ROWS)})
    assert rows == list(range(ROWS))

    def nested():
        # A local run inside one with datasets is a job of its own, without them; the
        # outer one's are back once it returns.
        (inner,) = horovod_ray.run(lambda: horovod_ray.get_dataset_shard.__name__, local=True)
        try:
            horovod_ray.run(lambda: horovod_ray.get_dataset_shard("train"), local=True)
        except horovod_ray.DatasetNotFoundError as err:
            return inner, str(err), read_all()[:3]

    (outcome,) = horovod_ray.run(nested, local=True, datasets={"train": ray.data.range(10)})
    assert outcome[0] == "get_dataset_shard" and "no datasets" in outcome[1]
    assert outcome[2] == [0, 1, 2]
    assert _no_coordinator_left()
    with pytest.raises(KeyError, match="no datasets"):  # a DatasetNotFoundError
        horovod_ray.get_dataset_shard("train")  # the local run's datasets went with it


@pytest.mark.parametrize(
    ("kwargs", "parameter", "says"),
    [
        ({"datasets": [1, 2]}, "datasets", "dict of name -> ray.data.Dataset"),
        ({"datasets": {}}, "datasets", "non-empty"),
        ({"datasets": {"train": [1, 2, 3]}}, "datasets", "datasets['train'] must be a ray.data"),
        ({"datasets": {3: "x"}}, "datasets", "non-empty str"),
        ({"data_config": ray.train.DataConfig()}, "data_config", "give datasets= too"),
        ("bad config", "data_config", "must be a ray.train.DataConfig"),
        ("unknown split", "data_config", "splits ['test']"),
        ("too few rows", "datasets", "has 1 rows for 2 ranks"),
        ("elastic without max_workers", "max_workers", "needs max_workers"),
        ("resumable not a bool", "resumable", "resumable must be True or False"),
        ("no room", "datasets", "leaving Ray Data less than one"),
    ],
)
def test_bad_data_is_refused_before_anything_starts(kwargs, parameter, says):
    train = ray.data.range(1)
    named = {
        "bad config": {"datasets": {"train": train}, "data_config": {"split": "all"}},
        "unknown split": {
            "datasets": {"train": train},
            "data_config": ray.train.DataConfig(datasets_to_split=["test"]),
        },
        "too few rows": {"datasets": {"train": train}, "num_slots": 2},
        "elastic without max_workers": {"datasets": {"train": train}, "min_workers": 1},
        # The ranks would take all 4 CPUs of this Ray (started here: it cannot grow).
        "no room": {"datasets": {"train": train}, "cpus_per_slot": 4},
    }
    if kwargs == "resumable not a bool":
        with pytest.raises(ConfigError, match=re.escape(says)) as err:
            horovod_ray.DataConfig(resumable="yes")
        assert err.value.parameter == parameter
        return
    kwargs = named[kwargs] if isinstance(kwargs, str) else kwargs
    before = {a.actor_id for a in alive_actors()}
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        horovod_ray.run(lambda: None, **kwargs)
    assert err.value.parameter == parameter
    assert {a.actor_id for a in alive_actors()} == before  # not even a split coordinator


def test_the_tune_adapter_refuses_bad_data_when_it_is_made():
    from horovod_ray.tune import DistributedTrainableCreator

    with pytest.raises(ConfigError, match="has 1 rows for 2 ranks"):
        DistributedTrainableCreator(
            lambda config: None, num_slots=2, datasets={"train": ray.data.range(1)}
        )


def tune_epoch(config):
    import horovod.torch as hvd
    from ray import tune

    hvd.init()
    shard = horovod_ray.get_dataset_shard("train")
    rows = [int(i) for b in shard.iter_batches(batch_size=config["batch"]) for i in b["id"]]
    every = hvd.allgather_object(rows)
    tune.report({"rows": [len(r) for r in every], "distinct": len(set(sum(every, [])))})


def test_every_tune_trial_splits_the_datasets_over_its_own_ranks(tmp_path):
    from ray import tune

    from horovod_ray.tune import DistributedTrainableCreator

    trainable = DistributedTrainableCreator(
        tune_epoch, num_slots=2, datasets={"train": ray.data.range(ROWS)}
    )
    results = tune.Tuner(
        trainable,
        param_space={"batch": tune.grid_search([16, 100])},
        tune_config=tune.TuneConfig(max_concurrent_trials=1),
        run_config=tune.RunConfig(name="data", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert results.num_errors == 0
    for result in results:
        assert result.metrics["rows"] == [ROWS // 2, ROWS // 2]
        assert result.metrics["distinct"] == ROWS - 1
    assert _no_coordinator_left()
