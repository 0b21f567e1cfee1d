"""Epochs that go on where they stopped (``horovod_ray.DataConfig(resumable=True)``, and
every elastic job with datasets): a job restarted from its checkpoint, and an elastic job
that loses a node mid-epoch, train on every row of the epoch once, counted row by row."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray

import horovod_ray
from horovod_ray import RayExecutor
from test.conftest import shut_down_own_ray, start_cluster, start_local_ray

pytestmark = pytest.mark.timeout(600)

ROWS = 1001
BATCH = 10


def _rows_of(batch) -> list[int]:
    return [int(i) for i in batch["id"]]


def restarted_epoch(die_at: int, every: int) -> list[int]:
    """One epoch; rank 0 reports a checkpoint of the rows trained so far and the shard's
    position every ``every`` steps; rank 1 dies at step ``die_at`` of the first attempt."""
    import tempfile

    import horovod.torch as hvd
    from ray.train import Checkpoint, CheckpointUploadMode

    hvd.init()
    shard = horovod_ray.get_dataset_shard("train")
    seen: list[int] = []
    checkpoint = horovod_ray.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = json.loads(Path(folder, "state.json").read_text())
        shard.load_state_dict(saved["position"])
        seen = saved["seen"]
    for step, batch in enumerate(shard.iter_batches(batch_size=BATCH), 1):
        seen += [i for rows in hvd.allgather_object(_rows_of(batch)) for i in rows]
        if step == die_at and hvd.rank() == 1 and horovod_ray.attempt() == 0:
            os._exit(1)
        if step % every == 0:
            with tempfile.TemporaryDirectory() as folder:
                state = {"position": shard.state_dict(), "seen": seen}
                Path(folder, "state.json").write_text(json.dumps(state))
                horovod_ray.report(
                    {"step": step},
                    checkpoint=Checkpoint.from_directory(folder),
                    checkpoint_upload_mode=CheckpointUploadMode.SYNC,
                )
    return seen


def test_a_restarted_job_reads_on_from_its_checkpoint(tmp_path):
    start_local_ray(4)
    (seen, _) = horovod_ray.run(
        restarted_epoch, args=[23, 5], num_slots=2, max_restarts=1,
        storage_path=str(tmp_path), name="resumed",
        datasets={"train": ray.data.range(ROWS, override_num_blocks=7)},
        data_config=horovod_ray.DataConfig(resumable=True),
    )  # fmt: skip
    # Rows of steps 21-23 were read in the first attempt after its last checkpoint (step
    # 20), and again, once, after the restart: counted from that checkpoint, each once.
    assert len(seen) == len(set(seen)) == ROWS - 1  # one row waits: 1001 on 2 ranks
    assert set(seen) <= set(range(ROWS))


def elastic_epoch(folder: str) -> dict:
    """One epoch in horovod's elastic loop: each committed step adds every rank's rows to
    the state, whose ``data`` holds the shard's position."""
    import horovod.torch as hvd

    hvd.init()
    shard = horovod_ray.get_dataset_shard("train")
    state = hvd.elastic.TorchState(data=shard.state_dict(), seen=[], sizes=[])

    @hvd.elastic.run
    def loop(state):
        shard.load_state_dict(state.data)  # after a reset: rank 0's last commit
        if state.data["epoch"] > 0:
            return
        for batch in shard.iter_batches(batch_size=BATCH):
            rows = [i for part in hvd.allgather_object(_rows_of(batch)) for i in part]
            state.seen = [*state.seen, *rows]
            state.sizes = [*state.sizes, hvd.size()]
            state.data = shard.state_dict()
            state.commit()
            if hvd.rank() == 0:
                Path(folder, "steps.tmp").write_text(str(len(state.sizes)))
                os.replace(Path(folder, "steps.tmp"), Path(folder, "steps"))
            time.sleep(0.1)

    loop(state)
    return {"seen": state.seen, "sizes": state.sizes}


def test_an_elastic_job_that_loses_a_node_mid_epoch_reads_every_row_once(tmp_path):
    """3 ranks of 1 CPU on three 2-CPU nodes (Ray Data keeps a CPU whatever the world);
    a node with a rank goes at step 10 of 33."""
    cluster = start_cluster([0, 2, 2, 2])
    try:
        executor = RayExecutor(
            RayExecutor.create_settings(timeout_s=30),
            min_workers=2, max_workers=3, elastic_timeout=60,
            datasets={"train": ray.data.range(ROWS, override_num_blocks=7)},
        )  # fmt: skip
        executor.start()
        outcome: dict = {}
        try:

            def target() -> None:
                try:
                    outcome["results"] = executor.run(elastic_epoch, args=[str(tmp_path)])
                except BaseException as err:  # noqa: BLE001 - read below
                    outcome["error"] = err

            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            steps = tmp_path / "steps"
            deadline = time.monotonic() + 180
            while not (steps.exists() and int(steps.read_text()) >= 10):
                assert time.monotonic() < deadline and thread.is_alive(), outcome
                time.sleep(0.1)
            lost = next(node for node in cluster.worker_nodes if _has_a_rank(node.node_id))
            cluster.remove_node(lost)
            thread.join(240)
            assert not thread.is_alive() and "error" not in outcome, outcome
        finally:
            executor.stop()
        (job,) = [job for job in horovod_ray.jobs(all=True) if job.id == executor.job_id]
    finally:
        shut_down_own_ray()
    assert job.resets >= 1  # the world changed mid-epoch (and may have grown back)
    results = outcome["results"]
    seen, sizes = results[0]["seen"], results[0]["sizes"]
    assert all(r["seen"] == seen for r in results)  # one state on every rank
    assert len(sizes) > 10  # the epoch went on after the loss
    # Every row once among the committed steps; the last split's rows that wait for a
    # world-sized share are fewer than its ranks.
    assert len(seen) == len(set(seen))
    assert set(seen) <= set(range(ROWS)) and ROWS - len(seen) < sizes[-1]


def _has_a_rank(node_id: str) -> bool:
    from ray.util import state as ray_state

    actors = ray_state.list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("state", "=", "ALIVE"), ("class_name", "=", "Worker")],
        raise_on_missing_output=False,
    )
    return any(actor.node_id == node_id for actor in actors)
