"""Placement plans and horovodrun's host names matched to Ray nodes: pure, no Ray."""

from __future__ import annotations

import pytest

from horovod_ray.errors import ConfigError
from horovod_ray.job.layouts import WorkerLayout
from horovod_ray.job.placement import (
    PlacementPlan,
    match_hosts,
    plan_hosts,
    plan_new_group,
    timeout_message,
)

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def _node(node_id: str, ip: str, name: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "NodeManagerHostname": name,
            "Alive": alive}  # fmt: skip


NODES = [
    _node("head", "10.0.0.1", "head-host"),
    _node("n2", "10.0.0.2", "worker-2"),
    _node("n3", "10.0.0.3", "worker-3"),
    _node("gone", "10.0.0.4", "worker-4", alive=False),
]


@pytest.mark.parametrize(
    "hosts, nodes",
    [
        (["10.0.0.2", "worker-3"], ["n2", "n3"]),  # by address, by host name, in order
        (["localhost", "10.0.0.3"], ["head", "n3"]),  # localhost: the driver's node
        (["127.0.0.1"], ["head"]),
        (["worker-3", "head-host", "10.0.0.2"], ["n3", "head", "n2"]),
        (["n3", "10.0.0.2"], ["n3", "n2"]),  # a node id names its node too
    ],
)
def test_hosts_are_matched_to_nodes_in_the_order_given(hosts, nodes):
    assert match_hosts(hosts, NODES, driver_node_id="head") == nodes


@pytest.mark.parametrize(
    "hosts, text",
    [
        (["10.0.0.9"], "host '10.0.0.9' is no node of this Ray cluster"),
        (["worker-4"], "is no node"),  # a dead node is no node
    ],
)
def test_an_unknown_host_names_itself_and_lists_the_nodes(hosts, text):
    with pytest.raises(ConfigError) as raised:
        match_hosts(hosts, NODES, driver_node_id="head")
    assert raised.value.parameter == "hosts"
    assert text in str(raised.value)
    assert "10.0.0.1 (head-host), 10.0.0.2 (worker-2), 10.0.0.3 (worker-3)" in str(raised.value)


def test_a_node_named_twice_is_refused():
    with pytest.raises(ConfigError, match="'head-host' is a node named already"):
        match_hosts(["localhost", "head-host"], NODES, driver_node_id="head")


def test_two_nodes_on_one_address_are_ambiguous():
    twins = [_node("a", "10.0.0.5", "box"), _node("b", "10.0.0.5", "box")]
    with pytest.raises(ConfigError, match="names several nodes"):
        match_hosts(["10.0.0.5"], twins, driver_node_id="a")


def test_a_host_plan_pins_one_bundle_per_host_with_its_ranks():
    layout = WorkerLayout(hosts=[("10.0.0.2", 2), ("worker-3", 1)], cpus_per_worker=2)
    plan = plan_hosts(layout, ["n2", "n3"])
    assert plan.bundles == ({"CPU": 4.0}, {"CPU": 2.0})
    assert plan.worker_bundles == (0, 0, 1)
    assert plan.node_ids == ("n2", "n3")
    assert plan_new_group(WorkerLayout(num_workers=2)).node_ids == ()  # not pinned


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"hosts": [("a", 0)]}, "(host, ranks) pairs"),
        ({"hosts": "a:2"}, "(host, ranks) pairs"),
        ({"hosts": [("a", 1), ("a", 2)]}, "names a host twice"),
        ({"hosts": [("a", 1)], "num_workers": 2}, "give hosts alone"),
    ],
)
def test_a_bad_host_list_names_hosts(kwargs, text):
    with pytest.raises(ConfigError) as raised:
        WorkerLayout(**kwargs)
    assert raised.value.parameter == "hosts" and text in str(raised.value)


def test_a_placement_timeout_says_what_no_node_has():
    """A GPU job on a cluster without GPUs waits out its timeout (an autoscaler could add
    one); the error then says that no node has one, not only the counts."""
    plan = PlacementPlan(bundles=({"CPU": 1.0, "GPU": 1.0},) * 2, strategy="PACK",
                         worker_bundles=(0, 1))  # fmt: skip
    text = timeout_message(plan, 100, {"CPU": 3.0}, {"CPU": 4.0, "memory": 1e9})
    assert (
        "Available now: {'CPU': 3.0, 'GPU': 0.0}; cluster total: {'CPU': 4.0, 'GPU': 0.0}" in text
    )
    assert "No node of the cluster has GPU (an autoscaler may still add one)." in text
    assert "placement_group_timeout_s=100s" in text
    cpu_only = PlacementPlan(bundles=({"CPU": 2.0},), strategy="PACK", worker_bundles=(0,))
    text = timeout_message(cpu_only, 5, {}, {"CPU": 4.0, "GPU": 2.0})
    assert (
        "Available now: {'CPU': 0.0, 'GPU': 0.0}; cluster total: {'CPU': 4.0, 'GPU': 2.0}" in text
    )
    assert "No node" not in text
