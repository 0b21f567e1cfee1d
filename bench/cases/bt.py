"""BT: horovod.torch on horovod_ray against the peers a PyTorch user would pick instead.

* BT1, allreduce throughput: ``horovod.torch`` in a horovod_ray job against
  ``torch.distributed``'s gloo backend in Ray actors (what Ray Train's TorchTrainer
  runs), on the same float32 tensors, MB/s: at each of BT_SIZES on 2 ranks (``bt1_by_size``;
  ``bt1_ratio`` is the 64 MB point) and at 64 MB on 4 ranks.
* BT4, many small tensors: one step of 100 gradients of 100 KB on 2 ranks, through
  ``hvd.DistributedOptimizer`` against DistributedDataParallel's bucketed allreduce of
  the same gradients (the same SGD step after both), steps per second.
* BT2, one epoch of the digits model (``examples/pytorch_digits.py``'s data, model and
  batch size) on 2 ranks: horovod_ray with ``hvd.DistributedOptimizer`` against Ray Train's
  ``TorchTrainer`` (DistributedDataParallel, gloo), the second epoch timed inside the loop.
* BT3, cold start on 2 ranks: from the call to the first allreduce done, with PyTorch's
  import, in ``horovod_ray.run`` and in ``TorchTrainer.fit``.

Ray Train's current API (v2) is what a user gets, and it cannot share a process with the
v1 API that B2's HorovodTrainer needs: ``bench.run`` runs BT in a process of its own
(``python -m bench.cases.bt MODE OUT``), on a local Ray of its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time

import bench.harness.common  # noqa: F401 - Ray's environment before ray
from bench.harness.common import (
    NUM_CPUS,
    ROOT,
    Mode,
    alternate,
    horovod_ray_run,
    ratio,
    summary,
    timed,
)

WORKERS = 2
BATCH_SIZE = 32  # examples/pytorch_digits.py's default
SEED = 1234
EXAMPLE = str(ROOT / "examples" / "pytorch_digits.py")  # its data and model


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


BT_SIZES = (1 << 20, 16 << 20, 64 << 20, 256 << 20)
SMALL_TENSORS, SMALL_FLOATS = 100, 25_000  # BT4: 100 gradients of 100 KB


def bt1_points(mode: Mode) -> list[tuple[int, int]]:
    """(bytes, timed iterations) of each BT1 size: about the bytes of B1's loop at each,
    at least 5 and at most 100 iterations; B1's size alone in smaller modes."""
    sizes = BT_SIZES if mode.b1_bytes >= 64 << 20 else (mode.b1_bytes,)
    budget = mode.b1_bytes * mode.b1_iters
    return [(n, max(min(5, mode.b1_iters), min(100, budget // n))) for n in sizes]


def _allreduces(allreduce, points: list[tuple[int, int]], warmup: int, start) -> list[float]:
    """Seconds of each point's ``iters`` in-place float32 sum-allreduces, all ranks
    starting each point together (``start()``)."""
    import torch

    seconds = []
    for nbytes, iters in points:
        data = torch.ones(nbytes // 4)
        seconds.append(timed(lambda data=data: allreduce(data), iters, warmup, start))
    return seconds


def _small_module():
    """BT4's model: SMALL_TENSORS parameters whose gradients are all ones."""
    import torch

    class Many(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.ones(SMALL_FLOATS)) for _ in range(SMALL_TENSORS)
            )

        def forward(self):
            return sum(w.sum() for w in self.weights)

    return Many()


def hvd_figures(points: list[tuple[int, int]], warmup: int, steps: int) -> dict:
    """On a Horovod rank: BT1's seconds at each point, then BT4's steps per second
    (none with ``steps`` 0)."""
    import horovod.torch as hvd
    import torch

    hvd.init()

    def start():
        hvd.allreduce(torch.tensor(0.0), name="bt.start")

    seconds = _allreduces(
        lambda data: hvd.allreduce_(data, op=hvd.Sum, name="bt1"), points, warmup, start
    )
    if not steps:
        return {"seconds": seconds}
    model = _small_module()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=model.named_parameters(),
        op=hvd.Sum,
    )

    def step():
        optimizer.zero_grad()
        model().backward()
        optimizer.step()

    return {"seconds": seconds, "steps_per_s": steps / timed(step, steps, warmup, start)}


class _TorchDistRank:
    """A torch.distributed rank (gloo) in a Ray actor, as TorchTrainer's workers are."""

    def figures(
        self, rank: int, size: int, port: int, points: list, warmup: int, steps: int
    ) -> dict:
        """The same as ``hvd_figures``, with DistributedDataParallel for BT4."""
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        try:
            seconds = _allreduces(dist.all_reduce, points, warmup, dist.barrier)
            if not steps:
                return {"seconds": seconds}
            model = _small_module()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

            def step():
                optimizer.zero_grad()
                ddp().backward()
                optimizer.step()

            steps_per_s = steps / timed(step, steps, warmup, dist.barrier)
            return {"seconds": seconds, "steps_per_s": steps_per_s}
        finally:
            dist.destroy_process_group()


def torch_distributed_figures(workers: int, points: list, warmup: int, steps: int) -> dict:
    """BT1's and BT4's peer: fresh Ray actors joined in a gloo process group; rank 0's."""
    import ray

    rank_actor = ray.remote(num_cpus=1)(_TorchDistRank)
    actors = [rank_actor.remote() for _ in range(workers)]
    try:
        port = free_port()
        return ray.get(
            [
                a.figures.remote(r, workers, port, points, warmup, steps)
                for r, a in enumerate(actors)
            ]
        )[0]
    finally:
        for actor in actors:
            ray.kill(actor)


def _digits(rank: int, size: int):
    """examples/pytorch_digits.py's training shard of rank ``rank``, and its model."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("pytorch_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    x_train, _, y_train, _ = example.digits()
    torch.manual_seed(SEED)
    x = torch.from_numpy(x_train[rank::size])
    y = torch.from_numpy(y_train[rank::size])
    return x, y, example.classifier()


def _epoch(model, optimizer, x, y) -> float:
    """One epoch in BATCH_SIZE batches; its seconds."""
    import torch

    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.perf_counter()
    for start in range(0, len(x), BATCH_SIZE):
        optimizer.zero_grad()
        loss_fn(model(x[start : start + BATCH_SIZE]), y[start : start + BATCH_SIZE]).backward()
        optimizer.step()
    return time.perf_counter() - started


def hvd_epoch_seconds() -> float:
    """BT2 on a Horovod rank: the second epoch's seconds (the first warms up)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    x, y, model = _digits(hvd.rank(), hvd.size())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.001 * hvd.size()),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _epoch(model, optimizer, x, y)
    return _epoch(model, optimizer, x, y)


def _rank_zero_writes(config: dict, metrics: dict) -> None:
    """A TorchTrainer worker's figures, from rank 0, to the file the driver named (Ray
    Train v2 keeps reported metrics only beside a checkpoint)."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        with open(config["out"], "w") as handle:
            json.dump(metrics, handle)


def _trainer_epoch_loop(config: dict) -> None:
    """BT2 on a TorchTrainer worker: the same, with the model in DDP."""
    import ray.train
    import ray.train.torch
    import torch

    context = ray.train.get_context()
    x, y, model = _digits(context.get_world_rank(), context.get_world_size())
    model = ray.train.torch.prepare_model(model)  # DistributedDataParallel, gloo on CPU
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * context.get_world_size())
    _epoch(model, optimizer, x, y)
    _rank_zero_writes(config, {"seconds": _epoch(model, optimizer, x, y)})


def first_allreduce_at() -> float:
    """BT3 on a Horovod rank: imports PyTorch, joins Horovod, one allreduce; wall time."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.tensor(1.0), name="bt3")
    return time.time()


def _trainer_first_allreduce_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.tensor(1.0))
    _rank_zero_writes(config, {"at": time.time()})


def _trainer_metrics(loop, storage: str) -> dict:
    """``TorchTrainer`` of ``loop`` on WORKERS workers; what its rank 0 wrote."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(storage, "metrics.json")
    trainer = TorchTrainer(
        loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(storage_path=storage),
    )
    trainer.fit()
    with open(out) as handle:
        return json.load(handle)


def bt(mode: Mode) -> dict:
    import horovod_ray

    print("BT horovod.torch against torch.distributed and TorchTrainer", flush=True)
    points, warmup = bt1_points(mode), mode.b1_warmup
    steps = max(10, mode.b3_calls // 2)  # BT4: 150 steps in the full mode
    four = [(mode.b1_bytes, mode.b1_iters)]  # 64 MB on 4 ranks
    runs = alternate(
        {
            "horovod_ray": lambda: horovod_ray_run(WORKERS, hvd_figures, points, warmup, steps)[0],
            "torch.distributed": lambda: torch_distributed_figures(WORKERS, points, warmup, steps),
            "horovod_ray x4": lambda: horovod_ray_run(4, hvd_figures, four, warmup, 0)[0],
            "torch.distributed x4": lambda: torch_distributed_figures(4, four, warmup, 0),
            # BT4 with the straggler's attribution (horovod's response cache off).
            "horovod_ray find_stragglers": lambda: horovod_ray_run(
                WORKERS, hvd_figures, [], warmup, steps, find_stragglers=True
            )[0],
        },
        mode.reps,
    )
    out: dict = {"bt_setup": {"points": points, "workers": WORKERS, "bt4_steps": steps}}
    by_size: dict = {}
    for ranks, suffix, where in ((WORKERS, "", points), (4, " x4", four)):
        for i, (nbytes, iters) in enumerate(where):
            mbps = {
                name: [nbytes * iters / 1e6 / run["seconds"][i] for run in runs[name + suffix]]
                for name in ("horovod_ray", "torch.distributed")
            }
            by_size[f"{nbytes >> 20} MB x{ranks}"] = {
                **{name: summary(v) for name, v in mbps.items()},
                "ratio": ratio(mbps["horovod_ray"], mbps["torch.distributed"]),
            }
    out["bt1_by_size"] = by_size
    main = by_size[f"{mode.b1_bytes >> 20} MB x{WORKERS}"]
    out["bt1_allreduce_mbps"] = {n: main[n] for n in ("horovod_ray", "torch.distributed")}
    out["bt1_ratio"] = main["ratio"]
    small = {
        "horovod_ray": [run["steps_per_s"] for run in runs["horovod_ray"]],
        "DDP": [run["steps_per_s"] for run in runs["torch.distributed"]],
    }
    stragglers = [run["steps_per_s"] for run in runs["horovod_ray find_stragglers"]]
    out["bt4_steps_per_s"] = {
        **{name: summary(v) for name, v in small.items()},
        "horovod_ray find_stragglers": summary(stragglers),
    }
    out["bt4_ratio"] = ratio(small["horovod_ray"], small["DDP"])
    out["bt4_ratio_stragglers_on_vs_off"] = ratio(stragglers, small["horovod_ray"])
    with tempfile.TemporaryDirectory() as storage:
        epoch = alternate(
            {
                "horovod_ray": lambda: horovod_ray_run(WORKERS, hvd_epoch_seconds)[0],
                # The metrics' cost on many small steps.
                "horovod_ray metrics off": lambda: horovod_ray_run(
                    WORKERS, hvd_epoch_seconds, metrics=False
                )[0],
                "TorchTrainer": lambda: _trainer_metrics(_trainer_epoch_loop, storage)["seconds"],
            },
            mode.reps,
        )

        def hvd_cold() -> float:
            started = time.time()
            return max(horovod_ray.run(first_allreduce_at, num_slots=WORKERS)) - started

        def trainer_cold() -> float:
            started = time.time()
            return _trainer_metrics(_trainer_first_allreduce_loop, storage)["at"] - started

        cold = alternate({"horovod_ray": hvd_cold, "TorchTrainer": trainer_cold}, mode.reps, True)
    out["bt2_epoch_s"] = {name: summary(v) for name, v in epoch.items()}
    out["bt2_ratio"] = ratio(epoch["horovod_ray"], epoch["TorchTrainer"])
    out["bt2_ratio_metrics_on_vs_off"] = ratio(
        epoch["horovod_ray"], epoch["horovod_ray metrics off"]
    )
    out["bt3_cold_start_s"] = {name: summary(v) for name, v in cold.items()}
    out["bt3_ratio"] = ratio(cold["horovod_ray"], cold["TorchTrainer"])
    return out


def main(argv: list[str]) -> int:
    """``python -m bench.cases.bt MODE OUT``: BT on a local Ray of its own; JSON to OUT."""
    from bench.harness.common import MODES
    from horovod_ray import local_ray

    mode_name, out_path = argv
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # Ray Train's current API (bench.harness.common: v1)
    local_ray.start(num_cpus=NUM_CPUS, log_to_driver=False)
    try:
        results = bt(MODES[mode_name])
    finally:
        local_ray.stop()
    with open(out_path, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
