"""``nics``: the interface each node's ranks give Gloo (rank/network), on a real local
Ray with real Horovod collectives."""

from __future__ import annotations

import os

import pytest
import ray

from horovod_ray import ConfigError, ExecutorState, RayExecutor
from horovod_ray.rank.network import interface_holding, local_interfaces
from test.horovod_identity import horovod_identity as identity

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


def horovod_identity():
    """What Horovod says about this rank (after one allreduce), its node, its env."""
    return {
        **identity(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
    }


def test_nics_none_of_which_a_node_has_fail_the_start_and_release_everything(ray_4cpu, no_leaks):
    settings = RayExecutor.create_settings(timeout_s=60, nics=["ens-none0", "eth-none1"])
    executor = RayExecutor(settings, num_workers=2)
    with pytest.raises(ConfigError, match=r"some nodes have none of these interfaces") as info:
        executor.start()
    assert info.value.parameter == "nics"
    assert "'lo'" in str(info.value)  # what the node does have
    assert executor.state is ExecutorState.FAILED


def test_nics_take_the_first_interface_a_node_has(ray_4cpu, no_leaks):
    # Not loopback, which a job on one node uses without nics.
    node_ip = ray.util.get_node_ip_address()
    iface = interface_holding(local_interfaces(), node_ip)
    assert iface not in (None, "lo"), "this test needs the node's address on a real interface"
    settings = RayExecutor.create_settings(timeout_s=60, nics=["ens-none0", iface, "lo"])
    with RayExecutor(settings, num_workers=2) as executor:
        assert [r["sum"] for r in executor.run(horovod_identity)] == [3.0, 3.0]
        assert executor.run(lambda: os.environ["HOROVOD_GLOO_IFACE"]) == [iface, iface]
