"""The rank bring-up's pure parts, shared by both kinds of job (no Ray)."""

from __future__ import annotations

import threading

import pytest

from horovod_ray.job.bringup import NodeGpus, bind_address, is_local, rank_env, stall_env
from horovod_ray.rank.assignment import RankInfo

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


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
        "NCCL_SOCKET_IFNAME": "lo",
        "MY_FLAG": "1",
    }


def test_nccl_follows_gloos_interface_unless_the_extras_name_one():
    rank = RankInfo(0, 1, 0, 1, 0, 1, "node-a", ())
    assert rank_env(rank, {}, "eth1", {})["NCCL_SOCKET_IFNAME"] == "eth1"
    assert rank_env(rank, {}, "eth1", {"NCCL_SOCKET_IFNAME": "ib0"})["NCCL_SOCKET_IFNAME"] == "ib0"


def test_ranks_starting_one_by_one_see_their_nodes_gpus_once_all_are_there():
    gpus = NodeGpus()
    seen = {}

    def slot(key, local_rank, own):
        gpus.add("node-a", key, own)
        seen[key] = gpus.visible("node-a", key, local_rank, 2, timeout_s=30, check=lambda: None)

    first = threading.Thread(target=slot, args=("s1", 1, ("1",)))
    first.start()
    first.join(0.3)
    assert first.is_alive()  # waits for the node's second rank
    gpus.add("node-b", "other", ("0",))  # another node's ranks do not count
    first.join(0.3)
    assert first.is_alive()
    slot("s2", 0, ("10",))
    first.join(10)
    # Each sees both, its own at its local rank: gpus[local_rank] is its own.
    assert seen == {"s1": ("10", "1"), "s2": ("10", "1")}


def test_a_rank_joining_a_survivor_after_a_reset_takes_a_gpu_of_its_own():
    """World 1: node b had one rank (GPU 2, local rank 0, sees ("2",)). Node a is lost;
    the new world puts a second rank on b (GPU 0, local rank 1). Sorted, ("0", "2"), the
    newcomer's gpus[1] would be the survivor's GPU 2; its own goes at index 1 instead."""
    gpus = NodeGpus()
    gpus.add("node-b", "survivor", ("2",))
    assert gpus.visible("node-b", "survivor", 0, 1, timeout_s=1, check=lambda: None) == ("2",)
    gpus.add("node-b", "newcomer", ("0",))
    newcomer = gpus.visible("node-b", "newcomer", 1, 2, timeout_s=1, check=lambda: None)
    assert newcomer == ("2", "0") and newcomer[1] == "0"
    # A rank that ended leaves; its replacement at local rank 0 sees the survivor's GPU too.
    gpus.remove("node-b", "survivor")
    gpus.add("node-b", "replacement", ("3",))
    assert gpus.visible("node-b", "replacement", 0, 2, 1, lambda: None) == ("3", "0")


def test_a_wait_for_gpus_ends_when_the_slot_is_let_go():
    gpus = NodeGpus()
    gpus.add("node-a", "s1", ("0",))

    def released():
        raise RuntimeError("let go")

    with pytest.raises(RuntimeError, match="let go"):
        gpus.visible("node-a", "s1", 0, 2, timeout_s=30, check=released)


@pytest.mark.parametrize(
    "timeout_s, period, shutdown",
    [(600, "60", "600"), (3600, "60", "3600"), (30, "3", "30"), (2.5, "1", "3")],
)
def test_the_stall_timeout_sets_horovods_stall_inspector(timeout_s, period, shutdown):
    """It looks once a period (a tenth of the timeout, 1 to 60 s): a stall is found within
    the timeout plus one period."""
    assert stall_env(timeout_s) == {
        "HOROVOD_STALL_CHECK_TIME_SECONDS": period,
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": shutdown,
    }


def test_a_stall_timeout_of_0_leaves_horovods_defaults():
    assert stall_env(0) == {}  # a warning each minute, no shutdown


@pytest.mark.parametrize(("drivers", "ranks"), [(None, "1048576"), ("0", "0"), ("4096", "4096")])
def test_every_rank_takes_the_drivers_exchange_limit_or_the_default(monkeypatch, drivers, ranks):
    """Ranks that disagree on it take different paths for one allreduce and wait on each
    other until Gloo's timeout: a node's own environment (a late elastic host started
    without it) must not decide it."""
    from types import SimpleNamespace

    from horovod_ray.job.bringup import common_env
    from horovod_ray.settings import create_settings

    if drivers is None:
        monkeypatch.delenv("HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES", drivers)
    server = SimpleNamespace(worker_address="127.0.0.1/secret", address=("127.0.0.1", 1234))
    env = common_env(server, create_settings(), elastic=True)
    assert env["HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES"] == ranks
