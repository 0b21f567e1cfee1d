"""A Ray cluster over simulated hosts, shared by the tests of this folder.

Hosts (each a network namespace with its own address, host name and /etc/hosts):

=====  =========  =====  ============================  =================================
host   interface  CPUs   its host name resolves to     role
=====  =========  =====  ============================  =================================
h1     eth0       2      its own address               Ray head; drivers run here
h2     ens5       2      127.0.1.1 (Debian's default)  Ray node
h3     eth0       2      127.0.1.1 (Debian's default)  Ray node
h4     eth0       -      its own address               no Ray node: a Ray Client machine
=====  =========  =====  ============================  =================================

h1, h2 and h3 are also joined by a second network (10.213.8.0/24) that Ray does not use,
through interfaces named ib0, ib1 and ib0: only ``nics`` can make Gloo use it.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from test.hosts.simhosts import SimHosts, sweep_stale, unavailable_reason

CPUS_PER_HOST = 2
SECOND_SUBNET = "10.213.8"


@pytest.fixture(scope="package")
def sim() -> Iterator[SimHosts]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()  # what a killed run of these tests left behind
    hosts = SimHosts()
    with hosts:
        head = hosts.add_host("h1", iface="eth0")
        hosts.add_host("h2", iface="ens5", loopback_hostname=True)
        hosts.add_host("h3", iface="eth0", loopback_hostname=True)
        hosts.add_host("h4", iface="eth0")
        # A second network that the Ray nodes do not use, for nics to choose.
        hosts.second_network = hosts.add_network(
            "br1", SECOND_SUBNET, {"h1": "ib0", "h2": "ib1", "h3": "ib0"}
        )
        hosts.start_ray(head, CPUS_PER_HOST, head=True)
        for name in ("h2", "h3"):
            hosts.start_ray(hosts.hosts[name], CPUS_PER_HOST)
        hosts.wait_for_nodes()
        yield hosts
    leftovers = hosts.leftovers()
    assert not leftovers, f"the harness left {leftovers} behind"


@pytest.fixture
def cluster(sim: SimHosts) -> SimHosts:
    """The harness with all three Ray hosts up (a host a test crashed is started again)."""
    crashed = [sim.hosts[name] for name in ("h2", "h3") if not sim.hosts[name].pids()]
    for host in crashed:
        sim.start_ray(host, CPUS_PER_HOST)
    if crashed:
        sim.wait_for_nodes()
    return sim
