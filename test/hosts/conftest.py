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
"""

from __future__ import annotations

from typing import Iterator

import pytest

from test.hosts.simhosts import SimHosts, unavailable_reason

CPUS_PER_HOST = 2


@pytest.fixture(scope="package")
def sim() -> Iterator[SimHosts]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    hosts = SimHosts()
    with hosts:
        head = hosts.add_host("h1", iface="eth0")
        hosts.add_host("h2", iface="ens5", loopback_hostname=True)
        hosts.add_host("h3", iface="eth0", loopback_hostname=True)
        hosts.add_host("h4", iface="eth0")
        hosts.start_ray(head, CPUS_PER_HOST, head=True)
        for name in ("h2", "h3"):
            hosts.start_ray(hosts.hosts[name], CPUS_PER_HOST)
        hosts.wait_for_nodes(3)
        yield hosts
    leftovers = hosts.leftovers()
    assert not leftovers, f"the harness left {leftovers} behind"


@pytest.fixture
def cluster(sim: SimHosts) -> SimHosts:
    """The harness with all three Ray hosts up (a test that crashed one gets it back)."""
    missing = [h for h in ("h2", "h3") if not sim.hosts[h].ray_node]
    for name in missing:
        sim.start_ray(sim.hosts[name], CPUS_PER_HOST)
    if missing:
        sim.wait_for_nodes(3)
    return sim
