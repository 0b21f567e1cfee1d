"""One training function that checkpoints through ``horovod_ray.report`` and resumes from
``horovod_ray.get_checkpoint``, run unchanged by ``run()``, ``RayExecutor``, the command
line and Tune in the tests.

The "training" is deterministic: ``state += allreduce(rank + step)`` each step, so an
uninterrupted run of 2 ranks ends with ``sum(2 * step + 1)`` whatever restarts it took.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time


def _collectives(framework: str):
    """(rank, sum over ranks of a number, every rank's list of one int) for a framework."""
    if framework == "torch":
        import horovod.torch as hvd
        import torch

        hvd.init()
        return (
            hvd.rank(),
            lambda x: float(hvd.allreduce(torch.tensor(float(x)), op=hvd.Sum)),
            lambda n: hvd.allgather(torch.tensor([n])).tolist(),
        )
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    return (
        hvd.rank(),
        lambda x: float(hvd.allreduce(tf.constant(float(x)), op=hvd.Sum).numpy()),
        lambda n: hvd.allgather(tf.constant([n])).numpy().tolist(),
    )


def _wait_committed(step: int, timeout_s: float = 60) -> None:
    """Waits until the run's storage holds the checkpoint of ``step`` steps (none to wait
    for under Tune, whose reports are not this package's uploads)."""
    from horovod_ray.checkpoints import choices, store
    from horovod_ray.checkpoints.spec import RunStorage

    storage = RunStorage.from_env()
    deadline = time.monotonic() + timeout_s
    while storage is not None and time.monotonic() < deadline:
        newest = choices.latest(store.list_entries(storage))
        if newest is not None and newest.metrics.get("step") == step:
            return
        time.sleep(0.05)


def checkpointed_sum(config: dict) -> dict:
    """``config``: ``steps``; ``framework`` ("torch" or "tensorflow"); ``die_at``: rank
    1 is killed at that step when the job started without a checkpoint, once the
    checkpoint before it is committed. Returns (and reports) where each rank resumed."""
    from ray.train import Checkpoint

    import horovod_ray

    rank, allreduce, allgather = _collectives(config.get("framework", "torch"))
    state, start = 0.0, 0
    checkpoint = horovod_ray.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, "state.json")) as handle:
                saved = json.load(handle)
        state, start = saved["state"], saved["step"]
    resumed = allgather(start)
    for step in range(start, config["steps"]):
        if step == config.get("die_at") and checkpoint is None and rank == 1:
            _wait_committed(step)
            os.kill(os.getpid(), signal.SIGKILL)
        state += allreduce(rank + step)
        with tempfile.TemporaryDirectory() as directory:
            with open(os.path.join(directory, "state.json"), "w") as handle:
                json.dump({"state": state, "step": step + 1}, handle)
            horovod_ray.report(
                {"state": state, "step": step + 1, "resumed_from": resumed},
                checkpoint=Checkpoint.from_directory(directory),
            )
    return {"rank": rank, "resumed_from": start, "state": state}


def expected_state(steps: int) -> float:
    """What 2 ranks end with: sum over steps of (0 + step) + (1 + step)."""
    return float(sum(2 * step + 1 for step in range(steps)))


def steps_told_of_drains(folder: str, framework: str = "torch") -> dict:
    """Steps (an allreduce each) from the latest checkpoint, as Ray Train's docs show for
    spot nodes. The first attempt writes ``started.<rank>`` (its node id) at step 3, asks
    for the preemption notice after each step and, given one, writes it to
    ``notice.<attempt>.<rank>`` and reports a checkpoint (rank 0's report then waits to be
    stopped); it ends at ``folder/finish`` whatever happened. A restarted attempt does 5
    steps more. Rank 0 appends ``attempt step`` to ``done`` for each step it completed."""
    from pathlib import Path

    from ray.train import Checkpoint

    import horovod_ray

    rank, allreduce, _ = _collectives(framework)
    attempt, node = horovod_ray.attempt(), os.environ["HOROVOD_HOSTNAME"]
    step, notices = 0, []
    checkpoint = horovod_ray.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            step = int(Path(path, "step").read_text())
    last = step + 5 if attempt else 10_000
    while step < last and not Path(folder, "finish").exists():
        allreduce(1)
        step += 1
        if rank == 0:
            with open(Path(folder, "done"), "a") as handle:
                handle.write(f"{attempt} {step}\n")
        if step == 3 and attempt == 0:
            Path(folder, f"started.{rank}").write_text(node)
        info = horovod_ray.get_preemption_info()
        if info is not None:
            notices.append([info.deadline_ms, info.preempted_node_to_ranks])
            Path(folder, f"notice.{attempt}.{rank}").write_text(json.dumps(notices[-1]))
            with tempfile.TemporaryDirectory() as path:
                Path(path, "step").write_text(str(step))
                horovod_ray.report({"step": step}, checkpoint=Checkpoint.from_directory(path))
        time.sleep(0.05)
    return {"attempt": attempt, "node": node, "rank": rank, "step": step, "notices": notices}
