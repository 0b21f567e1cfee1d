"""B12: a failed job's restart that resumes from its checkpoint, against Ray Train v2
(``python -m bench.cases.resume MODE OUT``).

Both run the same loop on 2 ranks (torch, Gloo): an allreduce every ``PAUSE_S``, rank 0
reporting a checkpoint of the step after each one; in the first attempt rank 1 dies at
step ``DIE_AT``. horovod_ray: ``run(max_restarts=1, storage_path=...)`` with
``horovod_ray.report`` / ``get_checkpoint``. Ray Train: a ``TorchTrainer`` with
``FailureConfig(max_failures=1)`` and ``ray.train.report`` / ``get_checkpoint``.
Measured: the seconds from the death to the first step the new attempt finishes, and
the steps it did again (``DIE_AT`` less the step it resumed at). horovod_ray's figure
includes its 1 s back-off before a restart. In a process of its own: Ray Train v2 cannot
share one with the v1 API that B2 uses.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import bench.harness.common  # noqa: F401 - Ray's environment before ray
from bench.cases.b6 import _first_step
from bench.harness.common import Mode, alternate, ratio, summary

DIE_AT = 20
STEPS = DIE_AT + 5
PAUSE_S = 0.05


def _mark(folder: str, name: str, text: str) -> None:
    path = os.path.join(folder, name)
    Path(path + ".tmp").write_text(text)
    os.replace(path + ".tmp", path)


def _steps(folder, rank, size, step, first_attempt, allreduce, report) -> None:
    """The loop both run: from ``step`` to ``STEPS``; rank 0 writes its progress (B6's
    format) and reports a checkpoint of each step; rank 1 dies at ``DIE_AT`` once."""
    if rank == 0:
        _mark(folder, "resumed", str(step))
    while step < STEPS:
        if step == DIE_AT and rank == 1 and first_attempt:
            _mark(folder, "died", str(time.time()))
            os._exit(1)
        allreduce()
        step += 1
        if rank == 0:
            _mark(folder, "progress", f"{step} {size} {time.time()}")
        with tempfile.TemporaryDirectory() as path:
            Path(path, "step").write_text(str(step))
            report(step, path if rank == 0 else None)
        time.sleep(PAUSE_S)


def _read_step(checkpoint) -> int:
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as path:
        return int(Path(path, "step").read_text())


def _horovod_ray_loop(folder: str) -> None:
    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint

    import horovod_ray

    hvd.init()

    def report(step: int, path: str | None) -> None:
        checkpoint = None if path is None else Checkpoint.from_directory(path)
        horovod_ray.report({"step": step}, checkpoint=checkpoint)

    checkpoint = horovod_ray.get_checkpoint()
    _steps(
        folder, hvd.rank(), hvd.size(), _read_step(checkpoint), checkpoint is None,
        lambda: hvd.allreduce(torch.ones(1)), report,
    )  # fmt: skip


def _train_loop(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    context = ray.train.get_context()

    def report(step: int, path: str | None) -> None:
        checkpoint = None if path is None else ray.train.Checkpoint.from_directory(path)
        ray.train.report({"step": step}, checkpoint=checkpoint)

    checkpoint = ray.train.get_checkpoint()
    _steps(
        config["folder"], context.get_world_rank(), context.get_world_size(),
        _read_step(checkpoint), checkpoint is None, lambda: dist.all_reduce(torch.ones(1)),
        report,
    )  # fmt: skip


def _recovered(folder: Path) -> tuple[float, int]:
    died = float((folder / "died").read_text())
    seconds = _first_step(folder, 2, died, timeout_s=5) - died
    return seconds, DIE_AT - int((folder / "resumed").read_text())


def _horovod_ray(storage: str) -> tuple[float, int]:
    import horovod_ray

    with tempfile.TemporaryDirectory() as folder:
        horovod_ray.run(
            _horovod_ray_loop, args=(folder,), num_slots=2, max_restarts=1,
            storage_path=storage, name=f"b12-{time.time_ns()}",
        )  # fmt: skip
        return _recovered(Path(folder))


def _ray_train(storage: str) -> tuple[float, int]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as folder:
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"folder": folder},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                storage_path=storage,
                name=f"b12-{time.time_ns()}",
                failure_config=FailureConfig(max_failures=1),
            ),
        )
        trainer.fit()
        return _recovered(Path(folder))


def resume(mode: Mode) -> dict:
    print("B12 a restart that resumes from its checkpoint", flush=True)
    from horovod_ray import local_ray

    local_ray.start(num_cpus=bench.harness.common.NUM_CPUS, log_to_driver=False)
    redone: dict[str, list[int]] = {"horovod_ray": [], "Ray Train v2": []}

    def timed(name, measure):
        def run() -> float:
            seconds, steps = measure(storage)
            redone[name].append(steps)
            print(f"  {name}: {seconds:.2f} s, steps done again {steps}", flush=True)
            return seconds

        return run

    with tempfile.TemporaryDirectory() as storage:
        runs = alternate(
            {
                "horovod_ray": timed("horovod_ray", _horovod_ray),
                "Ray Train v2": timed("Ray Train v2", _ray_train),
            },
            mode.resume_reps,
        )
    local_ray.stop()
    return {
        "b12_resume_s": {name: summary(values) for name, values in runs.items()},
        "b12_steps_done_again": {name: summary(values) for name, values in redone.items()},
        "b12_ratio_vs_train_v2": ratio(runs["horovod_ray"], runs["Ray Train v2"]),
    }


def main(argv: list[str]) -> int:
    from bench.harness.common import MODES

    mode_name, out_path = argv
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # Ray Train's current API (bench.harness.common: v1)
    results = resume(MODES[mode_name])
    with open(out_path, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
