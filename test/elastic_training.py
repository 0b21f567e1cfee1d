"""A horovod elastic loop for the elastic tests: one commit per step (``train`` on
horovod.torch, ``train_keras`` on a Keras model in its own elastic state).

Each step allreduces a one and records ``(step, size, sum)`` in the committed state, so
the final history shows every step exactly once and the world size it ran at. Every rank
logs ``{"step", "size"}`` (only rank 0's reach the callbacks). Rank 0 writes its latest
step and size to ``progress`` (the test watches it); the loop ends once ``finish`` exists,
a decision every rank takes together (a broadcast from rank 0). The result's ``begun`` lists
each step this rank began, kept outside the state: a rollback shows there as a step begun
twice.
"""

from __future__ import annotations

import json
import os
import time

import horovod_ray


def train(folder: str, pause_s: float = 0.1, max_steps: int = 10_000) -> dict:
    """The loop around horovod's PyTorch elastic state: ``hvd.elastic.TorchState`` holds a
    model, its ``hvd.DistributedOptimizer`` and an ``hvd.elastic.ElasticSampler``, and each
    step trains one batch of the rank's share of the samples left in the epoch. The result
    also carries the model's weights, which every rank must hold alike."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(hvd.rank())  # different weights until the state's first sync
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, sampler=sampler, step=0, history=[], epochs=0
    )
    batches: dict = {}

    def fresh_batches() -> None:
        # Lazily: the sampler shards what is left of the epoch when the first batch is
        # drawn, after a reset's sync has set the new world's ranks.
        batches["iterator"] = iter(loader)

    fresh_batches()
    state.register_reset_callbacks([fresh_batches])

    def step() -> float:
        batch = next(batches["iterator"], None)
        if batch is None:  # the epoch is done: the next one, all samples again
            state.epochs += 1
            state.sampler.set_epoch(state.epochs)
            fresh_batches()
            batch = next(batches["iterator"])
        x, y = batch
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.sampler.record_batch(0, len(x))
        return float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum))

    result = _loop(hvd, state, step, folder, pause_s, max_steps)
    weights = torch.cat([p.detach().ravel() for p in model.parameters()]).tolist()
    return {**result, "weights": weights, "epochs": state.epochs}


def train_announced(folder: str) -> dict:
    """``train``, each rank first saying it started through horovod.ray's ``ray_logger``
    (in an elastic job every rank's dicts reach the callbacks, as there)."""
    from horovod_ray import ray_logger

    ray_logger.log({"started": True})
    return train(folder)


def train_keras(folder: str, pause_s: float = 0.1, max_steps: int = 10_000) -> dict:
    """The same loop around a Keras model in ``hvd.elastic.KerasState``: each step is one
    ``train_on_batch`` with ``hvd.DistributedOptimizer`` on the rank's own batch, and
    records the sum of the model's weights, the same on every rank while they are in step."""
    import horovod.tensorflow.keras as hvd
    import keras
    import numpy as np

    hvd.init()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])  # random per rank
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    state = hvd.elastic.KerasState(model, step=0, history=[])
    rng = np.random.default_rng(hvd.rank())

    def step() -> float:
        x = rng.normal(size=(8, 4)).astype("float32")
        model.train_on_batch(x, x.sum(axis=1, keepdims=True))
        return float(sum(np.sum(w) for w in model.get_weights()))

    import horovod.tensorflow  # the elastic loop and broadcast_object, which keras lacks

    return _loop(horovod.tensorflow, state, step, folder, pause_s, max_steps)


def _loop(hvd, state, step, folder: str, pause_s: float, max_steps: int) -> dict:
    """The elastic loop, with ``hvd`` the framework's horovod module."""

    begun: list[int] = []
    notices: list = []  # the first preemption notice this rank was given

    @hvd.elastic.run
    def loop(state):
        while state.step < max_steps:
            begun.append(state.step)
            value = step()
            # Rebound, not appended in place: restore() must roll the list back too.
            state.history = [*state.history, (state.step, hvd.size(), value)]
            finish = os.path.exists(os.path.join(folder, "finish"))
            finish = hvd.broadcast_object(finish, root_rank=0)
            state.step += 1
            state.commit()
            horovod_ray.log({"step": state.step, "size": hvd.size()})  # rank 0's reach us
            if hvd.rank() == 0:
                path = os.path.join(folder, "progress")
                with open(path + ".tmp", "w") as handle:
                    handle.write(f"{state.step} {hvd.size()}")
                os.replace(path + ".tmp", path)
            info = horovod_ray.get_preemption_info()  # a collective, after the commit
            if info is not None and not notices:
                notices.append([info.deadline_ms, info.preempted_node_to_ranks])
                if hvd.rank() == 0:
                    with open(os.path.join(folder, "notice"), "w") as handle:
                        json.dump(notices[0], handle)
            if finish:
                break
            time.sleep(pause_s)
        return state.history

    history = loop(state)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_size": hvd.local_size(),
        "history": history,
        "begun": begun,
        "notices": notices,
    }


def grow_after_a_slow_start(folder: str, until: int = 0, steps: int = 300) -> list[int]:
    """Enters horovod's elastic loop only once ``folder/go`` exists, as a rank with a slow
    import or data load would, after saying it started (``folder/started.<rank>``); then
    commits a step every 0.2 s, up to ``steps``, until 3 steps ran on ``until`` ranks (by
    default: on more ranks than the first step). Returns the world's size at each step.
    While ``folder/hold`` exists, a rank that starts waits before ``hvd.init()``: a joining
    rank's slow start, which keeps the others in their reset."""
    import time
    from pathlib import Path

    import horovod.torch as hvd
    import torch

    while Path(folder, "hold").exists():
        time.sleep(0.1)
    hvd.init()
    Path(folder, f"started.{hvd.rank()}").touch()
    while not Path(folder, "go").exists():
        time.sleep(0.1)
    state = hvd.elastic.TorchState(sizes=[])

    @hvd.elastic.run
    def loop(state):
        while len(state.sizes) < steps:
            total = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name="grow.step")
            state.sizes = [*state.sizes, int(total)]
            # The same on every rank: the sizes are the state's, synced at each reset.
            grown = hvd.size() == until if until else hvd.size() > state.sizes[0]
            if grown and state.sizes[-3:] == [hvd.size()] * 3:
                break
            time.sleep(0.2)
            state.commit()
        return state.sizes

    return loop(state)


class Heard(horovod_ray.Callback):
    """What a job's callbacks heard: rank 0's log() dicts in ``logs``, each change of
    membership in ``changes`` (a plain callable gets only the first)."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.changes: list[dict] = []

    def __call__(self, item: dict) -> None:
        self.logs.append(item)

    def on_membership(self, change: dict) -> None:
        self.changes.append(change)


def progress(folder) -> tuple[int, int]:
    """Rank 0's last committed step and the world size it ran on, from ``folder``'s
    ``progress`` file (0, 0 before any)."""
    try:
        step, size = open(os.path.join(folder, "progress")).read().split()
        return int(step), int(size)
    except (FileNotFoundError, ValueError):
        return 0, 0
