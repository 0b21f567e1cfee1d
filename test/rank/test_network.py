"""Interface choice and the hostname check: pure decisions over node facts, no Ray."""

from __future__ import annotations

import pytest

from horovod_ray import ConfigError, HorovodRayError
from horovod_ray.rank.network import (
    NodeFacts,
    check_hostnames,
    choose_iface,
    gloo_iface,
    gloo_ifaces,
    hostname_problem,
)

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def node(**facts) -> NodeFacts:
    base = {
        "node_id": "a" * 40,
        "node_ip": "10.0.0.2",
        "node_ip_iface": "ens5",
        "loopback_iface": "lo",
        "interfaces": ("ens5", "lo"),
        "hostname": "worker-2",
        "hostname_address": "10.0.0.2",
        "gloo_iface_fixed": False,
    }
    return NodeFacts(**{**base, **facts})


@pytest.mark.parametrize(
    "nics, interfaces, expected",
    [
        (["eth0", "ens5"], ["lo", "ens5"], "ens5"),
        (["eth0", "ens5"], ["lo", "ens5", "eth0"], "eth0"),  # order of nics, not of the node
        (["ib0"], ["lo", "eth0"], None),
        ([], ["lo"], None),
    ],
)
def test_choose_iface_takes_the_first_of_nics_the_node_has(nics, interfaces, expected):
    assert choose_iface(nics, interfaces) == expected


@pytest.mark.parametrize(
    "facts, nics, local_job, expected",
    [
        ({}, None, False, "ens5"),  # the interface holding the node's Ray address
        ({}, None, True, "lo"),  # a job wholly on one node stays on loopback
        ({}, ("eth0", "lo"), False, "lo"),
        ({"interfaces": ("eth0", "ens5", "lo")}, ("eth0", "ens5"), False, "eth0"),
    ],
)
def test_gloo_iface(facts, nics, local_job, expected):
    assert gloo_iface(node(**facts), nics, local_job) == expected


def test_gloo_ifaces_names_every_node_without_any_of_nics_and_what_it_has():
    nodes = [
        node(),
        node(node_ip="10.0.0.3", interfaces=("eth0", "lo")),
        node(node_ip="10.0.0.4", interfaces=("ib0", "lo")),
    ]
    with pytest.raises(ConfigError) as info:
        gloo_ifaces(nodes, ("eth0", "ib0"), False)
    assert info.value.parameter == "nics"
    text = str(info.value)
    assert "node 10.0.0.2 (aaaaaaaaaaaa) has ['ens5', 'lo']" in text
    assert "10.0.0.3" not in text and "10.0.0.4" not in text
    assert gloo_ifaces(nodes[1:], ("eth0", "ib0"), False) == ["eth0", "ib0"]


def test_gloo_iface_without_nics_needs_an_interface_holding_the_address():
    with pytest.raises(HorovodRayError, match="pass nics="):
        gloo_iface(node(node_ip_iface=None), None, False)


@pytest.mark.parametrize(
    "facts, local_job, refused",
    [
        ({"hostname_address": "127.0.1.1"}, False, True),  # Debian's /etc/hosts default
        ({"hostname_address": "::1"}, False, True),
        ({"hostname_address": None}, False, True),  # the name does not resolve
        ({"hostname_address": "10.0.0.2"}, False, False),
        ({"hostname_address": "127.0.1.1", "gloo_iface_fixed": True}, False, False),
        ({"hostname_address": "127.0.1.1"}, True, False),  # one node: loopback is right
    ],
)
def test_hostname_problem(facts, local_job, refused):
    assert (hostname_problem(node(**facts), local_job) is not None) is refused


def test_check_hostnames_names_each_node_and_both_fixes():
    nodes = [
        node(),
        node(node_ip="10.0.0.3", hostname="worker-3", hostname_address="127.0.1.1"),
        node(node_ip="10.0.0.4", hostname="worker-4", hostname_address="127.0.1.1"),
    ]
    with pytest.raises(HorovodRayError) as info:
        check_hostnames(nodes, local_job=False)
    text = str(info.value)
    assert "10.0.0.3" in text and "'worker-4' resolves to 127.0.1.1" in text
    assert "10.0.0.2" not in text
    assert "patches/horovod-0.28.1-gloo-process-set-iface.patch" in text and "/etc/hosts" in text
    check_hostnames(nodes, local_job=True)
