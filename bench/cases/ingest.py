"""B13: Ray Data into the ranks, against Ray Train v2's ``datasets=`` and against each rank
reading for itself (``python -m bench.cases.ingest MODE OUT``).

The same pipeline, ``ray.data.range(ROWS).map_batches(features)`` (32 float32 features a
row), read as torch batches of ``BATCH`` rows for ``EPOCHS`` epochs by 2 and 4 ranks,
each step ending in a one-float allreduce (as a training step's gradients do):

* horovod_ray: ``run(..., datasets={"train": ds})``, ``get_dataset_shard("train")``;
* Ray Train v2: a ``TorchTrainer`` with ``datasets={"train": ds}``,
  ``ray.train.get_dataset_shard("train")``, ``torch.distributed``'s allreduce;
* by hand: horovod_ray's ranks without ``datasets=``, each computing the same features for
  its part through a torch ``DataLoader`` with a ``DistributedSampler``.

Measured on the ranks: rows a second, the rows every rank took over the slowest rank's
seconds from its first batch asked to its last step done. 4 ranks take half a CPU each, so
that the 4-CPU Ray keeps 2 for Ray Data, as 2 ranks of one CPU do. In a process of its
own: Ray Train v2 cannot share one with the v1 API that B2 uses.
"""

from __future__ import annotations

import json
import os
import sys
import time

import bench.harness.common  # noqa: F401 - Ray's environment before ray
from bench.harness.common import Mode, alternate, ratio, summary

BATCH = 256
EPOCHS = 2
FEATURES = 32


def features(batch: dict) -> dict:
    """The preprocessing every system runs: 32 float32 features and a label per row."""
    import numpy as np

    ids = batch["id"].astype("float32")
    x = np.sin(ids[:, None] * np.arange(1, FEATURES + 1, dtype="float32") / 1000)
    return {"x": x.astype("float32"), "y": (ids % 10).astype("float32")}


def _epochs(batches, allreduce) -> tuple[int, float]:
    """Rows taken and seconds spent by one rank over ``EPOCHS`` passes of ``batches()``."""
    rows, began = 0, time.perf_counter()
    for _ in range(EPOCHS):
        for batch in batches():
            rows += len(batch["y"])
            allreduce()
    return rows, time.perf_counter() - began


def _horovod_ray_rank() -> tuple[int, float]:
    import horovod.torch as hvd
    import torch

    import horovod_ray

    hvd.init()
    shard = horovod_ray.get_dataset_shard("train")
    return _epochs(
        lambda: shard.iter_torch_batches(batch_size=BATCH), lambda: hvd.allreduce(torch.ones(1))
    )


def _by_hand_rank(rows: int) -> tuple[int, float]:
    import horovod.torch as hvd
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    hvd.init()

    class Rows(Dataset):
        def __len__(self) -> int:
            return rows

        def __getitem__(self, index: int) -> dict:
            one = features({"id": np.array([index])})
            return {"x": torch.from_numpy(one["x"][0]), "y": torch.tensor(one["y"][0])}

    sampler = DistributedSampler(Rows(), num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    loader = DataLoader(Rows(), batch_size=BATCH, sampler=sampler)
    return _epochs(lambda: loader, lambda: hvd.allreduce(torch.ones(1)))


def _train_v2_loop(config: dict) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    shard = ray.train.get_dataset_shard("train")
    rows, seconds = _epochs(
        lambda: shard.iter_torch_batches(batch_size=BATCH), lambda: dist.all_reduce(torch.ones(1))
    )
    ray.train.report({"rows": rows, "seconds": seconds})
    with open(
        os.path.join(config["folder"], f"rank{ray.train.get_context().get_world_rank()}"), "w"
    ) as out:
        json.dump([rows, seconds], out)


def _rate(per_rank: list[tuple[int, float]]) -> float:
    return sum(rows for rows, _ in per_rank) / max(seconds for _, seconds in per_rank)


def _horovod_ray(ranks: int, rows: int) -> float:
    import ray

    import horovod_ray

    dataset = ray.data.range(rows).map_batches(features)
    return _rate(
        horovod_ray.run(
            _horovod_ray_rank,
            num_slots=ranks,
            cpus_per_slot=2 / ranks,
            datasets={"train": dataset},
        )  # fmt: skip
    )


def _by_hand(ranks: int, rows: int) -> float:
    import horovod_ray

    return _rate(
        horovod_ray.run(_by_hand_rank, args=[rows], num_slots=ranks, cpus_per_slot=2 / ranks)
    )


def _train_v2(ranks: int, rows: int) -> float:
    import tempfile

    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as folder:
        TorchTrainer(
            _train_v2_loop,
            train_loop_config={"folder": folder},
            scaling_config=ScalingConfig(
                num_workers=ranks, resources_per_worker={"CPU": 2 / ranks}
            ),
            datasets={"train": ray.data.range(rows).map_batches(features)},
        ).fit()
        per_rank = []
        for rank in range(ranks):
            with open(os.path.join(folder, f"rank{rank}")) as handle:
                per_rank.append(tuple(json.load(handle)))
    return _rate(per_rank)


def ingest(mode: Mode) -> dict:
    print("B13 Ray Data into the ranks (rows/s)", flush=True)
    from horovod_ray import local_ray

    local_ray.start(num_cpus=bench.harness.common.NUM_CPUS, log_to_driver=False)
    figures: dict = {"b13_rows": mode.ingest_rows, "b13_batch": BATCH, "b13_epochs": EPOCHS}
    for ranks in mode.ingest_ranks:
        runs = alternate(
            {
                "horovod_ray": lambda r=ranks: _horovod_ray(r, mode.ingest_rows),
                "Ray Train v2": lambda r=ranks: _train_v2(r, mode.ingest_rows),
                "by hand": lambda r=ranks: _by_hand(r, mode.ingest_rows),
            },
            mode.ingest_reps,
        )
        for name, values in runs.items():
            print(f"  {ranks} ranks {name}: {[round(v) for v in values]} rows/s", flush=True)
        figures[f"b13_rows_per_s_{ranks}"] = {n: summary(v) for n, v in runs.items()}
        figures[f"b13_ratio_vs_train_v2_{ranks}"] = ratio(runs["horovod_ray"], runs["Ray Train v2"])
        figures[f"b13_ratio_vs_by_hand_{ranks}"] = ratio(runs["horovod_ray"], runs["by hand"])
    local_ray.stop()
    return figures


def main(argv: list[str]) -> int:
    from bench.harness.common import MODES

    mode_name, out_path = argv
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # Ray Train's current API (bench.harness.common: v1)
    results = ingest(MODES[mode_name])
    with open(out_path, "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
