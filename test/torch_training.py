"""horovod.torch on every rank, for test_torch.py.

Every rank trains a linear model on data of its own (``_data(rank)``). Each function
returns plain numbers, and the test compares the ranks with each other and with what
plain PyTorch computes from every rank's data.
"""

from __future__ import annotations

FEATURES = 4


def _data(rank: int, rows: int = 64):
    """Rank ``rank``'s data: the same linear target, seen through different samples."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 0.3 * rank
    return x, y[:, None]


def _model(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, 1)


def _flat(model) -> list[float]:
    import torch

    return torch.cat([p.detach().ravel() for p in model.parameters()]).tolist()


def _summed_gradients(model, x, y, passes: int) -> list:
    """Plain PyTorch: the mean-squared-error gradients of ``model`` summed over ``passes``
    equal batches of ``x``."""
    import torch

    model.zero_grad()
    for xb, yb in zip(x.chunk(passes), y.chunk(passes), strict=True):
        torch.nn.functional.mse_loss(model(xb), yb).backward()
    return [p.grad.clone() for p in model.parameters()]


def optimizer_step(passes: int = 1, fp16: bool = False, compiled: bool = False) -> dict:
    """One SGD step of ``hvd.DistributedOptimizer`` (``passes`` backward passes per step)
    from rank 0's broadcast weights; returns the weights and what plain PyTorch expects:
    the step along the gradients summed over the passes, averaged over the ranks."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    model = _model(seed=hvd.rank())  # different on every rank until the broadcast
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = _flat(model)
    # The expectation, from every rank's data on a copy of the broadcast model.
    reference = _model(seed=0)
    reference.load_state_dict(model.state_dict())
    ranks = [_summed_gradients(reference, *_data(r), passes) for r in range(hvd.size())]
    expected = [
        p.detach() - 0.1 * torch.stack([g[i] for g in ranks]).mean(dim=0)
        for i, p in enumerate(reference.parameters())
    ]
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none,
    )
    forward = torch.compile(model) if compiled else model
    x, y = _data(hvd.rank())
    optimizer.zero_grad()
    for xb, yb in zip(x.chunk(passes), y.chunk(passes), strict=True):
        torch.nn.functional.mse_loss(forward(xb), yb).backward()
    optimizer.step()
    return {
        "start": start,
        "weights": _flat(model),
        "expected": torch.cat([e.ravel() for e in expected]).tolist(),
    }


def adasum_step() -> str:
    """``op=hvd.Adasum`` on a CPU build with Gloo: what a step says."""
    import horovod.torch as hvd
    import torch
    from horovod.common.exceptions import HorovodInternalError

    hvd.init()
    model = _model(seed=0)
    try:
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            op=hvd.Adasum,
        )
        x, y = _data(hvd.rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    except HorovodInternalError as error:  # the test wants the error itself
        return f"{type(error).__name__}: {error}"
    return "stepped"


def losses(epochs: int = 30) -> list[float]:
    """Training to convergence with the averaged gradients: the loss of each epoch."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    model = _model(seed=hvd.rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    x, y = _data(hvd.rank())
    history = []
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(float(hvd.allreduce(loss.detach())))
    return history


def collectives() -> dict:
    """horovod.torch's collectives, each in its plain, in-place and async forms where it
    has them; every value a plain number the test can check."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mine = torch.full((3,), float(rank + 1))
    out: dict = {}
    out["allreduce_sum"] = hvd.allreduce(mine, op=hvd.Sum).tolist()
    out["allreduce_average"] = hvd.allreduce(mine).tolist()
    inplace = mine.clone()
    hvd.allreduce_(inplace, op=hvd.Sum)
    out["allreduce_"] = inplace.tolist()
    handle = hvd.allreduce_async(mine, op=hvd.Max)
    out["allreduce_async_max"] = hvd.synchronize(handle).tolist()
    inplace = mine.clone()
    hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Min))
    out["allreduce_async_min"] = inplace.tolist()
    out["grouped_allreduce"] = [
        t.tolist() for t in hvd.grouped_allreduce([mine, mine * 10], op=hvd.Sum)
    ]
    group = [mine.clone(), mine.clone() * 10]
    hvd.grouped_allreduce_(group, op=hvd.Sum)
    out["grouped_allreduce_"] = [t.tolist() for t in group]
    # Rank r gives r + 1 rows: allgather takes tensors of different first dimensions.
    rows = torch.full((rank + 1, 2), float(rank))
    out["allgather"] = hvd.allgather(rows).tolist()
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(rows)).tolist()
    out["broadcast"] = hvd.broadcast(mine, root_rank=1).tolist()
    inplace = mine.clone()
    hvd.broadcast_(inplace, root_rank=0)
    out["broadcast_"] = inplace.tolist()
    out["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(mine, root_rank=1)).tolist()
    # alltoall: rank r sends 10 * r + d to rank d.
    sent = torch.tensor([float(10 * rank + d) for d in range(size)])
    received = hvd.alltoall(sent, splits=torch.ones(size, dtype=torch.int32))
    out["alltoall"] = (received[0] if isinstance(received, tuple) else received).tolist()
    out["broadcast_object"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    out["allgather_object"] = hvd.allgather_object(("rank", rank))
    return out


def small_allreduces() -> dict:
    """Allreduces under and over the size that horovod sends in one message to each rank
    (patches/horovod-0.28.1-gloo-exchange-allreduce.patch). Element k of ``order`` gives
    the ranks 1e8, 1 and -1e8 in the k-th of their 6 orders: float32 sums of those depend on
    the order of the additions, and the small allreduce adds in rank order on every rank
    (Gloo's ring adds each segment in an order of its own)."""
    import itertools

    import horovod.torch as hvd
    import numpy as np
    import torch

    hvd.init()
    rank = hvd.rank()
    values = np.array([1e8, 1.0, -1e8], dtype=np.float32)
    orders = list(itertools.permutations(range(3)))
    mine = torch.tensor([values[order[rank]] for order in orders])
    rank_order = [float((values[a] + values[b]) + values[c]) for a, b, c in orders]
    small = torch.full((5,), float(rank + 2))
    large = torch.full((1 << 20,), float(rank + 2))  # 4 MB: Gloo's ring
    return {
        "order": hvd.allreduce(mine, op=hvd.Sum).tolist(),
        "rank_order": rank_order,
        "ops": {
            name: hvd.allreduce(small, op=op).tolist()[0]
            for name, op in (
                ("sum", hvd.Sum),
                ("min", hvd.Min),
                ("max", hvd.Max),
                ("product", hvd.Product),
                ("average", hvd.Average),
            )
        },
        "integers": hvd.allreduce(torch.arange(7) * (rank + 1), op=hvd.Sum).tolist(),
        "large": sorted(set(hvd.allreduce(large, op=hvd.Sum).tolist())),
    }


def waiting_cpu(delay_s: float = 1.0) -> dict:
    """Rank 1 joins an allreduce ``delay_s`` late; each rank's wall time in it and the CPU
    time its own thread spent meanwhile. A thread that waits for horovod should sleep:
    stock horovod.torch polls in a loop that keeps a core busy for the whole wait,
    taking it from the threads that do the work
    (patches/horovod-0.28.1-torch-wait-without-spinning.patch)."""
    import time

    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.tensor(0.0), name="waiting_cpu.start")
    if hvd.rank() == 1:
        time.sleep(delay_s)
    wall, cpu = time.perf_counter(), time.thread_time()
    total = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name="waiting_cpu").item()
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.thread_time() - cpu,
        "sum": total,
    }


def collectives_under_a_long_cycle() -> dict:
    """Four collectives, each waited on at once, under a HOROVOD_CYCLE_TIME of seconds (set
    by the caller): the seconds they took and their sums. A caller waiting on a collective
    starts horovod's next cycle at once
    (patches/horovod-0.28.1-torch-waiting-caller-starts-the-cycle.patch); stock horovod's
    background thread sleeps out the cycle time first, so each would take up to a cycle."""
    import time

    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.tensor(0.0), name="long_cycle.start")
    started = time.perf_counter()
    sums = [hvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item() for _ in range(2)]
    sums += [t.item() for t in hvd.grouped_allreduce([torch.tensor(1.0)] * 2, op=hvd.Sum)]
    return {"seconds": time.perf_counter() - started, "sums": sums}


def horovods_threads_cpu(operations: int = 200, batches: int = 4) -> dict:
    """Milliseconds of CPU that the threads ``hvd.init()`` starts (horovod's background
    thread, Gloo's I/O threads) spend per 1 MB allreduce, ``operations`` in a row, in the
    least of ``batches`` such runs: another process that takes the core inflates a batch
    (on a busy machine one of 400 took up to 1.9 ms), a thread that spins inflates them
    all. In
    horovod's release, Gloo's I/O thread spins while another thread holds the connection
    it has an event for, and a send holds it while it writes the buffer: under Ray on 2
    cores one rank's threads took 2.3-2.6 ms of CPU per operation, 0.4-0.5 with
    patches/horovod-0.28.1-gloo-loop-waits-for-a-busy-pair.patch."""
    import os

    import horovod.torch as hvd
    import torch

    def threads_cpu() -> dict[str, float]:
        seconds = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # the thread ended
                continue
            seconds[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return seconds

    before_init = set(threads_cpu())
    hvd.init()
    data = torch.ones(1 << 18)
    for _ in range(20):
        hvd.allreduce_(data, op=hvd.Average, name="busy_pair")
    spent = []
    for _ in range(batches):
        start = threads_cpu()
        for _ in range(operations):
            hvd.allreduce_(data, op=hvd.Average, name="busy_pair")
        end = threads_cpu()
        spent.append(sum(end[t] - start.get(t, 0.0) for t in end if t not in before_init))
    return {"cpu_ms": min(spent) / operations * 1e3, "values": sorted(set(data.tolist()))}


def uneven_then_join() -> dict:
    """Rank r runs r + 1 allreduces, then joins: a joined rank's share is zero, ``join``
    returns the last rank to join, and named collectives go on afterwards. (Unnamed ones
    would not: horovod names them by a per-process count of operations, which the uneven
    ranks no longer share.)"""
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank = hvd.rank()
    sums = [
        hvd.allreduce(torch.tensor(float(rank + 1)), op=hvd.Sum, name=f"uneven.{step}").item()
        for step in range(rank + 1)
    ]
    last = hvd.join()
    after = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum, name="after_join").item()
    return {"sums": sums, "join": last, "after": after}


def sync_batch_norm() -> dict:
    """One training step of ``hvd.SyncBatchNorm`` on CPU tensors, each rank with a batch of
    its own (a different size on each), beside what plain ``BatchNorm1d`` computes from
    every rank's batch at once: the statistics, output, gradients and running statistics
    must agree (patches/horovod-0.28.1-torch-sync-batch-norm-cpu.patch; PyTorch has the
    kernels horovod uses on GPUs only)."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    generator = torch.Generator().manual_seed(7)  # the same on every rank
    counts = [6 + 2 * rank for rank in range(hvd.size())]
    every = torch.randn(sum(counts), FEATURES, 3, generator=generator) * 2 + 1
    upstream = torch.randn(every.shape, generator=generator)  # d(loss)/d(output)
    first = sum(counts[: hvd.rank()])
    rows = slice(first, first + counts[hvd.rank()])
    synced = hvd.SyncBatchNorm(FEATURES)
    plain = torch.nn.BatchNorm1d(FEATURES)
    for norm in (synced, plain):
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(1.0, 1.5, FEATURES))
            norm.bias.fill_(0.25)
    mine = every[rows].clone().requires_grad_()
    every.requires_grad_()
    output = synced(mine)
    output.backward(upstream[rows])
    expected = plain(every)
    expected.backward(upstream)

    def gap(a, b) -> float:
        return a.detach().sub(b.detach()).abs().max().item()

    return {
        "gaps": {
            "output": gap(output, expected[rows]),
            "input_grad": gap(mine.grad, every.grad[rows]),
            # Each rank's parameter gradients are its share: their sum is the whole's.
            "weight_grad": gap(hvd.allreduce(synced.weight.grad, op=hvd.Sum), plain.weight.grad),
            "bias_grad": gap(hvd.allreduce(synced.bias.grad, op=hvd.Sum), plain.bias.grad),
            "running_mean": gap(synced.running_mean, plain.running_mean),
            "running_var": gap(synced.running_var, plain.running_var),
        },
        # What the gaps are measured against: gradients far from 0.
        "sizes": [every.grad.abs().max().item(), plain.weight.grad.abs().max().item()],
    }


def waiter_cleared_by_shutdown() -> dict:
    """A thread waits on a collective that never completes (each rank names its own),
    ``hvd.shutdown()`` clears its handle so that its wait raises, and horovod starts
    again. Returns how many callers horovod's cycle counted as waiting then and after,
    what the waiter raised, and a sum after the restart. With the count stuck at 1, the
    background loop would cycle every millisecond from then on, whatever
    HOROVOD_CYCLE_TIME says (patches/horovod-0.28.1-torch-waiting-caller-starts-the-cycle.patch)."""
    import ctypes
    import threading
    import time

    import horovod.torch as hvd
    import torch
    from horovod.torch import mpi_lib_v2

    hvd.init()
    waiters = ctypes.CDLL(mpi_lib_v2.__file__).horovod_ray_cycle_waiters
    raised: list[str] = []

    def wait() -> None:
        try:
            hvd.allreduce(torch.ones(1), name=f"only on rank {hvd.rank()}")
        except Exception as error:  # noqa: BLE001 - what it raised is the result
            raised.append(f"{type(error).__name__}: {error}")

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 30
    while waiters() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    during = waiters()
    # Both ranks' waiters wait before either shuts down (which fails the other's wait).
    hvd.allreduce(torch.tensor(0.0), name="both wait")
    hvd.shutdown()
    waiter.join(30)
    after = waiters()
    hvd.init()
    total = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item()
    return {"during": during, "after": after, "raised": raised, "sum": total}
