"""BT: horovod.torch on horovod_ray against the peers a PyTorch user would pick instead.

* BT1, allreduce throughput on 2 ranks: ``horovod.torch`` in a horovod_ray job against
  ``torch.distributed``'s gloo backend in two Ray actors (what Ray Train's TorchTrainer
  runs), on the same float32 tensors, MB/s.
* BT2, one epoch of the digits model (``examples/pytorch_digits.py``'s data, model and
  batch size) on 2 ranks: horovod_ray with ``hvd.DistributedOptimizer`` against Ray Train's
  ``TorchTrainer`` (DistributedDataParallel, gloo), the second epoch timed inside the loop.
* BT3, cold start on 2 ranks: from the call to the first allreduce done, with PyTorch's
  import, in ``horovod_ray.run`` and in ``TorchTrainer.fit``.

Ray Train's current API (v2) is what a user gets, and it cannot share a process with the
v1 API that B2's HorovodTrainer needs: ``bench.run`` runs BT in a process of its own
(``python -m bench.bt MODE OUT``), on a local Ray of its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time

import bench.common  # noqa: F401 - Ray's environment before ray
from bench.common import NUM_CPUS, ROOT, Mode, alternate, horovod_ray_run, ratio, summary

WORKERS = 2
BATCH_SIZE = 32  # examples/pytorch_digits.py's default
SEED = 1234
EXAMPLE = str(ROOT / "examples" / "pytorch_digits.py")  # its data and model


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def hvd_allreduce_seconds(nbytes: int, iters: int, warmup: int) -> float:
    """BT1 on a Horovod rank: seconds for ``iters`` in-place float32 sum-allreduces."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    data = torch.ones(nbytes // 4)
    for _ in range(warmup):
        hvd.allreduce_(data, op=hvd.Sum, name="bt1")
    hvd.allreduce(torch.tensor(0.0), name="bt1.start")  # all ranks start together
    start = time.perf_counter()
    for _ in range(iters):
        hvd.allreduce_(data, op=hvd.Sum, name="bt1")
    return time.perf_counter() - start


class _TorchDistRank:
    """A torch.distributed rank (gloo) in a Ray actor, as TorchTrainer's workers are."""

    def seconds(self, rank: int, port: int, nbytes: int, iters: int, warmup: int) -> float:
        """BT1 on this rank: the same loop as ``hvd_allreduce_seconds``."""
        import torch
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS
        )
        try:
            data = torch.ones(nbytes // 4)
            for _ in range(warmup):
                dist.all_reduce(data)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(data)
            return time.perf_counter() - start
        finally:
            dist.destroy_process_group()


def torch_distributed_seconds(nbytes: int, iters: int, warmup: int) -> float:
    """BT1's peer: two fresh Ray actors joined in a gloo process group; rank 0's seconds."""
    import ray

    rank_actor = ray.remote(num_cpus=1)(_TorchDistRank)
    actors = [rank_actor.remote() for _ in range(WORKERS)]
    try:
        port = free_port()
        return ray.get(
            [a.seconds.remote(r, port, nbytes, iters, warmup) for r, a in enumerate(actors)]
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

    print("BT horovod.torch against torch.distributed and TorchTrainer, 2 workers", flush=True)
    nbytes, iters, warmup = mode.b1_bytes, mode.b1_iters, mode.b1_warmup
    megabytes = nbytes * iters / 1e6
    out: dict = {"bt_setup": {"bytes": nbytes, "iters": iters, "workers": WORKERS}}
    allreduce = alternate(
        {
            "horovod_ray": lambda: (
                megabytes
                / horovod_ray_run(WORKERS, hvd_allreduce_seconds, nbytes, iters, warmup)[0]
            ),
            "torch.distributed": lambda: (
                megabytes / torch_distributed_seconds(nbytes, iters, warmup)
            ),
        },
        mode.reps,
    )
    out["bt1_allreduce_mbps"] = {name: summary(v) for name, v in allreduce.items()}
    out["bt1_ratio"] = ratio(allreduce["horovod_ray"], allreduce["torch.distributed"])
    with tempfile.TemporaryDirectory() as storage:
        epoch = alternate(
            {
                "horovod_ray": lambda: horovod_ray_run(WORKERS, hvd_epoch_seconds)[0],
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
    out["bt3_cold_start_s"] = {name: summary(v) for name, v in cold.items()}
    out["bt3_ratio"] = ratio(cold["horovod_ray"], cold["TorchTrainer"])
    return out


def main(argv: list[str]) -> int:
    """``python -m bench.bt MODE OUT``: BT on a local Ray of its own; JSON to OUT."""
    from bench.common import MODES
    from horovod_ray import local_ray

    mode_name, out_path = argv
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # Ray Train's current API (bench.common: v1)
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
