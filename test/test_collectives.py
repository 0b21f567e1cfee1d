"""Every collective's result on 2, 3 and 4 real ranks, compared with one computed locally.

Many asynchronous collectives of several dtypes in flight at once from two threads, sizes
on each side of the exchange allreduce's limit (test/collective_checks.py). Stock Gloo's
reducescatter on a rank count that is not a power of two returns while a send may still
read the buffer that it and horovod then write
(patches/horovod-0.28.1-gloo-reduce-scatter-waits-for-its-sends.patch): a review saw wrong
results on ranks 0 and 1 of 3; the native test below makes that send slow, so that it is
wrong every time without the patch.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import horovod_ray
from test import collective_checks
from test.conftest import ROOT, horovod_gloo

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("num_slots", "env"),
    [
        (2, {}),
        (3, {}),
        (4, {}),
        # Gloo's own ring for every allreduce, beside its reducescatter.
        (3, {"HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES": "0"}),
    ],
    ids=["2-ranks", "3-ranks", "4-ranks", "3-ranks-without-the-exchange"],
)
@pytest.mark.gpu_line
def test_every_collective_gives_the_locally_computed_result(ray_4cpu, num_slots, env):
    batches = 3
    ranks = horovod_ray.run(
        collective_checks.check_every_collective,
        args=(batches,),
        num_slots=num_slots,
        env=env,
        timeout_s=120,
    )
    per_rank = 2 * batches * len(collective_checks.KINDS) * 2
    for rank in ranks:
        assert rank["raised"] == []
        assert rank["wrong"] == [], f"rank {rank['rank']} of {num_slots}"
        assert rank["checked"] == per_rank
    assert [rank["size"] for rank in ranks] == [num_slots] * num_slots


@pytest.mark.unit
def test_gloos_reducescatter_returns_only_once_its_sends_are_written(tmp_path):
    """Rank 2 of 3 sends rank 0 its half over a connection slowed down, and fills its
    buffer as soon as run() returns: rank 0 must still reduce what was there before
    (test/native/gloo_reduce_scatter_lifetime.cc)."""
    library, flags = horovod_gloo()
    program = tmp_path / "gloo_reduce_scatter_lifetime"
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    source = ROOT / "test/native/gloo_reduce_scatter_lifetime.cc"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-pthread", *flags, str(source), str(library)]
        + ["-o", str(program)],
        check=True,
        timeout=120,
    )
    done = subprocess.run([program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "right\n"), done.stdout + done.stderr
