"""The work every system does in the benchmarks: the same functions, the same data.

Each function runs on one Horovod rank, whatever started it (horovod_ray, horovod.ray,
Ray Train, horovodrun). Run as a script, this file is what ``horovodrun`` launches.
"""

from __future__ import annotations

import json
import os
import sys
import time


def allreduce_throughput(nbytes: int, iters: int, warmup: int) -> float:
    """B1: seconds for ``iters`` float32 sum-allreduces of ``nbytes``, after a warm-up."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    data = tf.ones(nbytes // 4, dtype=tf.float32)
    for _ in range(warmup):
        hvd.allreduce(data, op=hvd.Sum).numpy()
    hvd.allreduce(tf.constant(0.0), op=hvd.Sum).numpy()  # all ranks start together
    start = time.perf_counter()
    for _ in range(iters):
        result = hvd.allreduce(data, op=hvd.Sum)
    result.numpy()
    return time.perf_counter() - start


def first_allreduce() -> float:
    """B2: imports the framework, joins Horovod, does one allreduce; returns wall time."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()
    return time.time()


def _record(folder: str, step: int, size: int) -> None:
    """Rank 0's latest step: ``step size wall-time``, replaced atomically."""
    path = os.path.join(folder, "progress")
    with open(path + ".tmp", "w") as handle:
        handle.write(f"{step} {size} {time.time()}")
    os.replace(path + ".tmp", path)


def elastic_steps(folder: str, pause_s: float) -> tuple[int, int]:
    """B6 elastic: one allreduce and one commit per step, until ``folder/finish`` exists.
    Returns the steps done and how many of them this rank began more than once (after a
    rollback to the last commit)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    begun: set[int] = set()
    repeated = [0]

    @hvd.elastic.run
    def loop(state):
        while True:
            repeated[0] += state.step in begun
            begun.add(state.step)
            hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()
            finish = os.path.exists(os.path.join(folder, "finish"))
            finish = int(hvd.broadcast(tf.constant(int(finish)), root_rank=0).numpy())
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                _record(folder, state.step, hvd.size())
            if finish:
                return state.step
            time.sleep(pause_s)

    return loop(state), repeated[0]


def checkpointed_steps(folder: str, pause_s: float) -> int:
    """B6 restart: the same steps as a static job, resuming from rank 0's checkpoint."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    checkpoint = os.path.join(folder, "checkpoint")
    step = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
    step = int(hvd.broadcast(tf.constant(step), root_rank=0).numpy())
    while True:
        if str(step) == os.environ.get("B9_DIE_AT"):
            open(os.path.join(folder, "finish"), "w").close()
            with open(os.path.join(folder, "died"), "w") as handle:
                handle.write(str(time.time()))
            os._exit(1)
        hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()
        finish = os.path.exists(os.path.join(folder, "finish"))
        finish = int(hvd.broadcast(tf.constant(int(finish)), root_rank=0).numpy())
        step += 1
        if hvd.rank() == 0:
            with open(checkpoint + ".tmp", "w") as handle:
                handle.write(str(step))
            os.replace(checkpoint + ".tmp", checkpoint)
            _record(folder, step, hvd.size())
        if finish:
            return step
        time.sleep(pause_s)


def told_of_drains(folder: str, pause_s: float) -> int:
    """B10 static: a static job's steps (an allreduce each), resumed from the latest
    checkpoint; after each step it asks for the preemption notice and, given one, reports a
    just-in-time checkpoint, as Ray Train's docs show (B10's Train v2 peer does the same).
    Rank 0 writes its node to ``node`` and appends ``attempt step time`` to ``done`` for
    each step it completed. Returns the step it ended at, once ``folder/finish`` exists."""
    import tempfile

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from ray.train import Checkpoint

    import horovod_ray

    hvd.init()
    attempt, step, saved = horovod_ray.attempt(), 0, False
    checkpoint = horovod_ray.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            step = int(open(os.path.join(path, "step")).read())
    if hvd.rank() == 0:
        with open(os.path.join(folder, "node"), "w") as handle:
            handle.write(os.environ["HOROVOD_HOSTNAME"])
    while True:
        hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()
        finish = os.path.exists(os.path.join(folder, "finish"))
        finish = int(hvd.broadcast(tf.constant(int(finish)), root_rank=0).numpy())
        step += 1
        if hvd.rank() == 0:
            with open(os.path.join(folder, "done"), "a") as handle:
                handle.write(f"{attempt} {step} {time.time()}\n")
        if finish:
            return step
        if horovod_ray.get_preemption_info() is not None and not saved:
            with tempfile.TemporaryDirectory() as path:
                with open(os.path.join(path, "step"), "w") as handle:
                    handle.write(str(step))
                horovod_ray.report({"step": step}, checkpoint=Checkpoint.from_directory(path))
            saved = True
        time.sleep(pause_s)


def dies_once(folder: str, pause_s: float, die_at: int) -> int:
    """B9 restart: checkpointed steps; the first time, rank 1 dies before step
    ``die_at``'s collective, recording when and asking the next job to stop after one
    step. Returns the step it ended at."""
    if os.environ.get("HOROVOD_RANK") == "1" and not os.path.exists(f"{folder}/died"):
        os.environ["B9_DIE_AT"] = str(die_at)
    return checkpointed_steps(folder, pause_s)


def stalls(folder: str) -> None:
    """B9 hang: rank 1 records the time and never reaches the allreduce rank 0 waits in."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    hvd.allreduce(tf.constant(1.0)).numpy()
    if hvd.rank() == 1:
        with open(os.path.join(folder, "stalled"), "w") as handle:
            handle.write(str(time.time()))
        time.sleep(3600)
    hvd.allreduce(tf.constant(1.0)).numpy()


def noop(*_args) -> None:
    """B3: nothing, to measure the cost of a call itself."""
    return None


def one_report_trial(config: dict) -> None:
    """B4: a Tune trial that does one allreduce and reports once."""
    from ray import tune

    first_allreduce()
    tune.report({"done_at": time.time()})


def _main(argv: list[str]) -> int:
    """Entry point under horovodrun: ``workloads.py b1 BYTES ITERS WARMUP`` or ``b2``."""
    if argv[0] == "b1":
        seconds = allreduce_throughput(int(argv[1]), int(argv[2]), int(argv[3]))
        if os.environ.get("HOROVOD_RANK", "0") == "0":
            print(json.dumps({"seconds": seconds}), flush=True)
    elif argv[0] == "b2":
        print(json.dumps({"first_allreduce_at": first_allreduce()}), flush=True)
    else:
        raise SystemExit(f"unknown workload {argv[0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
