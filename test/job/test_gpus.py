"""GPUs: every rank of a node sees the node's GPUs (job/bringup), in both kinds of job,
on a real local Ray with fake GPUs."""

from __future__ import annotations

import os

import pytest
import ray

from horovod_ray import RayExecutor
from test.conftest import start_local_ray

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


def _gpus_seen() -> tuple[str, list[str], int]:
    """A rank's CUDA_VISIBLE_DEVICES, the GPUs Ray gave it, and its local rank."""
    import horovod.torch as hvd

    hvd.init()
    return os.environ["CUDA_VISIBLE_DEVICES"], [str(g) for g in ray.get_gpu_ids()], hvd.local_rank()


@pytest.mark.parametrize("kind", ["static", "elastic"])
def test_fake_gpus_share_cuda_visible_devices_per_node(kind):
    """Every rank of a node sees the node's GPUs, so that horovod's own idiom
    ``gpus[hvd.local_rank()]`` works on every local rank, in both kinds of job (an
    elastic rank once saw only its own GPU)."""
    start_local_ray(num_cpus=4, num_gpus=2)  # both kinds share it
    sizes = {"static": {"num_workers": 2}, "elastic": {"min_workers": 2, "max_workers": 2}}
    with RayExecutor(SETTINGS, use_gpu=True, **sizes[kind]) as executor:
        seen = executor.run(_gpus_seen)
    own = sorted((g for _, ids, _ in seen for g in ids), key=int)
    assert len(own) == 2
    # Each rank sees both GPUs (a static job's ranks, one sorted list).
    assert all(sorted(visible.split(","), key=int) == own for visible, _, _ in seen)
    if kind == "static":
        assert [visible for visible, _, _ in seen] == [",".join(own)] * 2
    # Local rank i takes GPU i of what it sees: two ranks, two different GPUs.
    assert sorted(visible.split(",")[local] for visible, _, local in seen) == own
