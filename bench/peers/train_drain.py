"""B10's peer: Ray Train v2 answering the same drain
(``python -m bench.peers.train_drain MODE OUT``).

Ray Train v2 (2.60) watches the nodes of its workers for drains: it tells the training
function through ``ray.train.get_preemption_info()``, so that it can report a
just-in-time checkpoint, tears the worker group down once the deadline passes, and starts
it again from the latest checkpoint. The same cluster as B10 (three 1-CPU nodes, a 0-CPU
head), a ``TorchTrainer`` of ``(2, 3)`` workers (elastic, so that it starts again on the
two nodes left) whose loop does B10's step (an allreduce every 50 ms, gloo), asks for the
preemption info after each step as Ray's docs show, and checkpoints on it. A node is
drained with a ``DEADLINE_S`` deadline and removed at it, as a cloud's provider takes
the node: from the drain to the first step on 2 workers,
and the steps done before it that the new run did again (:func:`redone`): the loop, as
Ray's docs show, trains on after its just-in-time checkpoint until the deadline. In a
process of its own: Ray Train v2 cannot share one with the v1 API that B2 uses.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench.harness.common  # noqa: F401 - Ray's environment before ray
from bench.cases.b6 import _first_step, _in_thread
from bench.harness.common import Mode, simulated_nodes, summary

DEADLINE_S = 15  # shorter than B10's 60 s: Ray Train waits it out before it starts again
PAUSE_S = 0.05


def _loop(config: dict) -> None:
    """A Ray Train worker: B10's steps, resumed from the latest checkpoint."""
    import ray.train
    import torch
    import torch.distributed as dist

    folder = config["folder"]
    context = ray.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            step = int(Path(path, "step").read_text())
    saved = False
    while True:
        # Rank 0 decides for all: a rank that left alone would strand the others.
        finish = torch.tensor([float(os.path.exists(os.path.join(folder, "finish")))])
        dist.broadcast(finish, src=0)
        if finish.item():
            return
        if rank == 0:
            with open(os.path.join(folder, "begun"), "a") as handle:
                handle.write(f"{step} {size} {time.time():.3f}\n")
        dist.all_reduce(torch.ones(1))
        step += 1
        if rank == 0:
            path = os.path.join(folder, "progress")
            Path(path + ".tmp").write_text(f"{step} {size} {time.time()}")
            os.replace(path + ".tmp", path)
        if ray.train.get_preemption_info() is not None and not saved:
            with tempfile.TemporaryDirectory() as path:
                Path(path, "step").write_text(str(step))
                saved_checkpoint = ray.train.Checkpoint.from_directory(path)
                ray.train.report({"step": step}, checkpoint=saved_checkpoint if rank == 0 else None)
            saved = True
        time.sleep(PAUSE_S)


def _measure(cluster, storage: str) -> tuple[float, int]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from test.autoscaling import drain_node

    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 3:  # the last run's workers are gone
        if time.monotonic() > deadline:
            raise RuntimeError("the last run's workers still hold the CPUs")
        time.sleep(0.2)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        trainer = TorchTrainer(
            _loop,
            train_loop_config={"folder": name},
            scaling_config=ScalingConfig(num_workers=(2, 3)),
            run_config=RunConfig(storage_path=storage, failure_config=FailureConfig()),
        )
        thread, outcome = _in_thread(trainer.fit)
        node, killer = None, None
        try:
            _first_step(folder, 3, 0.0)
            time.sleep(1)
            node = list(cluster.worker_nodes)[-1]
            at = time.time()
            drain_node(cluster.address, node.node_id, deadline_s=DEADLINE_S)
            # At the deadline the provider takes the node, as a cloud's would.
            killer = threading.Timer(DEADLINE_S, cluster.remove_node, args=(node,))
            killer.start()
            seconds = _first_step(folder, 2, at) - at
        finally:
            (folder / "finish").touch()
            thread.join(120)
            if killer is not None:
                killer.join()
        if thread.is_alive() or "error" in outcome:
            raise RuntimeError(f"the trainer did not end cleanly: {outcome.get('error')}")
        lines = (folder / "begun").read_text().splitlines()
        begun = [(int(step), int(size), float(t)) for step, size, t in map(str.split, lines)]
    return seconds, redone(begun, at)


def redone(begun: list[tuple[int, int, float]], at: float) -> int:
    """The steps the 2-worker run, after the drain at ``at``, began again: the step in
    flight before its first step, plus one, less the step it resumed at. Pure.

    Args:
        begun: (step, workers, time) of each step rank 0 began, in order.
        at: When the node was drained.
    """
    first = next(i for i, (_, size, t) in enumerate(begun) if size == 2 and t > at)
    in_flight = begun[first - 1][0]  # the last step begun before the world changed
    return max(0, in_flight + 1 - begun[first][0])


def train_drain(mode: Mode) -> dict:
    print("B10 Ray Train v2 answering a drain", flush=True)
    seconds, again = [], []
    with simulated_nodes((0,)) as cluster, tempfile.TemporaryDirectory() as storage:
        for _ in range(mode.b6e_reps):
            took, steps = _measure(cluster, storage)
            seconds.append(took)
            again.append(steps)
            print(f"  to 2 workers {took:.2f} s, steps done again {steps}", flush=True)
    return {
        "b10_train_v2_to_two_workers_s": summary(seconds),
        "b10_train_v2_steps_done_again": summary(again),
        "b10_train_v2_deadline_s": DEADLINE_S,
    }


def main(argv: list[str]) -> int:
    from bench.harness.common import MODES

    mode_name, out_path = argv
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # Ray Train's current API (bench.harness.common: v1)
    results = train_drain(MODES[mode_name])
    with open(out_path, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
