"""A stuck job: a rank that never reaches the collective the others entered fails the
job with HangError, naming it, the ranks that waited and what it was doing."""

from __future__ import annotations

import re
import time

import pytest

import horovod_ray
from horovod_ray import ExecutorState, HangError, RayExecutor

pytestmark = pytest.mark.timeout(180)


def _one_rank_sleeps(late: int) -> float:
    import horovod.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.tensor(1.0), name="warm_up")
    if hvd.rank() == late:
        time.sleep(600)  # the late rank's line
    return float(hvd.allreduce(torch.tensor(1.0), name="step"))


def test_a_rank_that_never_joins_a_collective_is_named_with_its_stack(ray_4cpu, no_leaks):
    """Found by horovod's stall inspector (patches/*-gloo-stall-inspector-ranks.patch:
    without it, it never sees a missing rank and the others wait for ever)."""
    settings = RayExecutor.create_settings(timeout_s=60, stall_timeout_s=3)
    executor = RayExecutor(settings, num_workers=3)
    executor.start()
    try:
        with pytest.raises(HangError) as info:
            executor.run(_one_rank_sleeps, args=(2,))
    finally:
        executor.stop()
    error = info.value
    assert (error.missing, error.waiting) == ((2,), (0, 1))
    assert list(error.failures) == [2]
    assert str(error).startswith(
        "Horovod job hung: rank(s) 2 did not reach a collective that rank(s) 0, 1 waited in "
        "for more than stall_timeout_s=3s; the job was stopped."
    )
    where = error.failures[2]
    assert re.search(rf'File "{re.escape(__file__)}", line \d+, in _one_rank_sleeps', where)
    assert "time.sleep(600)  # the late rank's line" in where
    # horovod.torch's name for the collective: the op, then the name given.
    assert re.search(r"never reached the collective \[allreduce\.step\]", where), where
    assert executor.state is ExecutorState.FAILED


def test_run_names_the_hang_too(ray_4cpu, no_leaks):
    with pytest.raises(HangError, match=r"rank\(s\) 0 did not reach"):
        horovod_ray.run(_one_rank_sleeps, args=(0,), num_slots=2, stall_timeout_s=2)


def _mismatched() -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    if hvd.rank() == 0:
        hvd.allreduce(torch.tensor(1.0))
    else:
        hvd.broadcast(torch.tensor(1.0), root_rank=0)


def test_ranks_in_different_collectives_are_named_too(ray_4cpu, no_leaks):
    """Each rank waits in a collective the other never enters: every rank raises."""
    with pytest.raises(HangError) as info:
        horovod_ray.run(_mismatched, num_slots=2, stall_timeout_s=2)
    assert (info.value.missing, info.value.waiting) == ((0, 1), ())
    text = str(info.value)
    assert "rank(s) 0, 1 waited in different collectives" in text
    assert re.search(r"rank 0: never reached the collective \[broadcast\.noname\.\d+\]", text), text
    assert re.search(r"rank 1: never reached the collective \[allreduce\.noname\.\d+\]", text), text
