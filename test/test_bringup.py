"""The rank bring-up's pure parts, shared by both kinds of job (no Ray)."""

from __future__ import annotations

import threading

import pytest

from horovod_ray.bringup import NodeGpus, bind_address, is_local, rank_env
from horovod_ray.ranks import RankInfo


@pytest.mark.parametrize(
    "node_ips, local",
    [
        (["10.0.0.1", "10.0.0.1"], True),  # simulated nodes, or a local Ray
        (["10.0.0.1", "10.0.0.2"], False),  # two machines
        (["10.0.0.2"], False),  # one node, but not the driver's machine
        ([], False),  # no node has room yet (a 0-CPU head): the driver's address
    ],
)
def test_one_rule_for_a_job_that_stays_on_the_drivers_machine(node_ips, local):
    assert is_local(node_ips, "10.0.0.1") is local
    assert bind_address(local, "10.0.0.1") == ("127.0.0.1" if local else "10.0.0.1")


def test_a_ranks_environment_is_its_identity_over_the_shared_part():
    rank = RankInfo(1, 4, 1, 2, 0, 2, "node-a", ("0", "1"))
    env = rank_env(rank, {"HOROVOD_CONTROLLER": "gloo"}, "lo", {"MY_FLAG": "1"})
    assert env == {
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_HOSTNAME": "node-a",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOROVOD_GLOO_IFACE": "lo",
        "MY_FLAG": "1",
    }


def test_ranks_starting_one_by_one_see_their_nodes_gpus_once_all_are_there():
    gpus = NodeGpus()
    seen = {}

    def slot(key, own):
        gpus.add("node-a", key, own)
        seen[key] = gpus.visible("node-a", 2, timeout_s=30, check=lambda: None)

    first = threading.Thread(target=slot, args=("s1", ("1",)))
    first.start()
    first.join(0.3)
    assert first.is_alive()  # waits for the node's second rank
    gpus.add("node-b", "other", ("0",))  # another node's ranks do not count
    first.join(0.3)
    assert first.is_alive()
    slot("s2", ("10",))
    first.join(10)
    assert seen == {"s1": ("1", "10"), "s2": ("1", "10")}
    # A rank that ended leaves; a rank that replaces it sees the survivor's GPU and its own.
    gpus.remove("node-a", "s1")
    assert gpus.visible("node-a", 2, timeout_s=0.05, check=lambda: None) == ("10",)
    slot("s3", ("2",))
    assert seen["s3"] == ("2", "10")


def test_a_wait_for_gpus_ends_when_the_slot_is_let_go():
    gpus = NodeGpus()
    gpus.add("node-a", "s1", ("0",))

    def released():
        raise RuntimeError("let go")

    with pytest.raises(RuntimeError, match="let go"):
        gpus.visible("node-a", 2, timeout_s=30, check=released)
