"""Every collective's result compared with one computed locally, on every rank, for
test_collectives.py.

Each collective of a batch is a ``Case``: its kind, reduction, dtype and size come from
its number, so every rank plans the same batches without talking. Rank ``r``'s input to a
case is ``_data(case, r)``: small integers, so that sums, products, minima and maxima are
exact in every dtype, and any rank can compute every other rank's input and so the
result the collective must return. Two threads each submit batches of asynchronous
collectives and only then wait on them, so that many are in flight at once, of several
dtypes, fused or not, on each side of the exchange allreduce's limit
(patches/horovod-0.28.1-gloo-exchange-allreduce.patch).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

KINDS = ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall", "grouped")
DTYPES = ("float32", "float64", "float16", "int32", "int64", "int8", "uint8")
# horovod.torch reduces no 8-bit integers.
REDUCED_DTYPES = DTYPES[:5]
REDUCTIONS = ("Sum", "Min", "Max", "Product", "Average")
# The exchange allreduce carries a buffer whose (size - 1) copies fit in this many bytes.
EXCHANGE_LIMIT_BYTES = 1 << 20


@dataclass(frozen=True)
class Case:
    """One collective of a batch; the same on every rank."""

    name: str
    kind: str
    dtype: str
    op: str
    elements: int
    root: int


def _elements(number: int, size: int, itemsize: int) -> int:
    """Sizes around the exchange limit for this dtype and world, and small ones."""
    limit = EXCHANGE_LIMIT_BYTES // ((size - 1) * itemsize)
    choices = (1, 7, 1000, limit - 1, limit, limit + 1, 2 * limit + 3)
    return choices[number % len(choices)]


def plan(thread: int, batch: int, size: int) -> list[Case]:
    """The collectives thread ``thread`` submits in batch ``batch``."""
    import torch

    cases = []
    for index in range(len(KINDS) * 2):
        number = (thread * 7 + batch) * 31 + index
        kind = KINDS[index % len(KINDS)]
        reduces = kind in ("allreduce", "reducescatter", "grouped")
        dtypes = REDUCED_DTYPES if reduces else DTYPES
        dtype = dtypes[(number // 3) % len(dtypes)]
        op = REDUCTIONS[number % len(REDUCTIONS)]
        if kind == "reducescatter":
            op = ("Sum", "Average")[number % 2]  # what horovod's reducescatter takes
        if op == "Average" and not getattr(torch, dtype).is_floating_point:
            op = "Sum"
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        elements = max(_elements(number // 5, size, itemsize), size)
        name = f"t{thread}.b{batch}.{index}.{kind}.{dtype}.{op}.{elements}"
        cases.append(Case(name, kind, dtype, op, elements, number % size))
    return cases


def _data(case: Case, rank: int, size: int):
    """Rank ``rank``'s input to ``case``: small integers of the case's dtype, whose sum or
    product over four ranks is exact in float16: Product's are in [1, 2], the others' in
    [-2, 2] (0-4 for uint8)."""
    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{rank}".encode()))
    low, high = (1, 3) if case.op == "Product" else (-2, 3)
    if case.dtype == "uint8":
        low, high = max(low, 0), high + 2
    rows = _rows(case, rank, size)
    values = torch.randint(low, high, (rows, 2), generator=generator)
    return values.to(getattr(torch, case.dtype))


def _rows(case: Case, rank: int, size: int) -> int:
    if case.kind == "allgather":
        return case.elements // 2 + rank  # a first dimension of its own on each rank
    if case.kind == "alltoall":
        return sum(_splits(case, rank, size))
    return max(case.elements // 2, 1)


def _splits(case: Case, rank: int, size: int) -> list[int]:
    """How many rows rank ``rank`` sends to each rank in an alltoall."""
    base = max(case.elements // (2 * size), 1)
    return [base + (rank + peer) % 3 for peer in range(size)]


def _reduce(case: Case, inputs: list):
    import torch

    stacked = torch.stack([tensor.to(torch.float64) for tensor in inputs])
    if case.op in ("Sum", "Average"):
        out = stacked.sum(0)
    elif case.op == "Min":
        out = stacked.min(0).values
    elif case.op == "Max":
        out = stacked.max(0).values
    else:
        out = stacked.prod(0)
    if case.op == "Average":
        out = out / len(inputs)
    return out


def expected(case: Case, rank: int, size: int):
    """What ``case`` must give rank ``rank``, from every rank's input."""
    import torch

    inputs = [_data(case, peer, size) for peer in range(size)]
    dtype = getattr(torch, case.dtype)
    if case.kind in ("allreduce", "grouped"):
        return _reduce(case, inputs).to(dtype)
    if case.kind == "reducescatter":
        reduced = _reduce(case, inputs).to(dtype)
        rows = reduced.shape[0]
        counts = [rows // size + (1 if peer < rows % size else 0) for peer in range(size)]
        start = sum(counts[:rank])
        return reduced[start : start + counts[rank]]
    if case.kind == "allgather":
        return torch.cat(inputs)
    if case.kind == "broadcast":
        return inputs[case.root]
    pieces = []
    for source in range(size):
        splits = _splits(case, source, size)
        start = sum(splits[:rank])
        pieces.append(inputs[source][start : start + splits[rank]])
    return torch.cat(pieces)


def submit(case: Case, rank: int, size: int):
    import horovod.torch as hvd

    tensor = _data(case, rank, size)
    op = getattr(hvd, case.op)
    if case.kind == "allreduce":
        return hvd.allreduce_async(tensor, name=case.name, op=op)
    if case.kind == "grouped":
        return hvd.grouped_allreduce_async([tensor], name=case.name, op=op)
    if case.kind == "reducescatter":
        return hvd.reducescatter_async(tensor, name=case.name, op=op)
    if case.kind == "allgather":
        return hvd.allgather_async(tensor, name=case.name)
    if case.kind == "broadcast":
        return hvd.broadcast_async(tensor, root_rank=case.root, name=case.name)
    import torch

    splits = torch.tensor(_splits(case, rank, size), dtype=torch.int32)
    return hvd.alltoall_async(tensor, splits=splits, name=case.name)


def _matches(case: Case, got, want) -> bool:
    import torch

    if isinstance(got, (list, tuple)):
        got = got[0]  # a grouped result, or an alltoall's (tensor, received splits)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if case.op == "Average":
        tolerance = 1e-2 if case.dtype == "float16" else 1e-6
        return torch.allclose(got.to(torch.float64), want.to(torch.float64), atol=tolerance)
    return torch.equal(got, want)


def check_every_collective(batches: int) -> dict:
    """Two threads each submit ``batches`` batches of asynchronous collectives, wait on
    each batch, and compare every result with the expected one. Returns how many were
    checked and the first mismatches, each named by its case."""
    import threading

    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    checked = [0, 0]
    wrong: list[str] = []
    raised: list[str] = []

    def thread(number: int) -> None:
        try:
            submit_and_check(number)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            raised.append(f"thread {number}: {error!r}")

    def submit_and_check(number: int) -> None:
        for batch in range(batches):
            cases = plan(number, batch, size)
            handles = [(case, submit(case, rank, size)) for case in cases]
            for case, handle in handles:
                got = hvd.synchronize(handle)
                if not _matches(case, got, expected(case, rank, size)):
                    wrong.append(case.name)
                checked[number] += 1

    threads = [threading.Thread(target=thread, args=(number,)) for number in range(2)]
    for started in threads:
        started.start()
    for started in threads:
        started.join()
    return {
        "rank": rank,
        "size": size,
        "checked": sum(checked),
        "wrong": wrong[:20],
        "raised": raised,
    }
