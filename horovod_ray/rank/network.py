"""Which network interface each rank's Gloo uses, and the host facts that decide it.

Pure decisions over the facts a worker reports about its node (``Worker.node_info``), so
they can be tested with tables; the lookups themselves are the small functions at the top.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from typing import Iterable, Mapping, Sequence

from horovod_ray.errors import ConfigError, HorovodRayError

PATCH_HINT = (
    "build horovod with the Gloo interface fix (`make install` in a horovod_ray checkout "
    "applies patches/horovod-0.28.1-gloo-process-set-iface.patch), or make the host's name "
    "resolve to its cluster address in /etc/hosts (replace the '127.0.1.1 <hostname>' line)"
)


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What a rank's worker reports about where it runs (``Worker.node_info``).

    Attributes:
        node_id: The Ray node.
        node_ip: The node's Ray address.
        node_ip_iface: The interface that holds ``node_ip`` (None if none does).
        loopback_iface: The interface that holds 127.0.0.1.
        interfaces: Every interface the node has, sorted.
        gpu_ids: The GPUs Ray gave the worker.
        hostname: The host's name.
        hostname_address: The address Gloo binds without an interface (only looked up
            where horovod lacks the fix, else None).
        gloo_iface_fixed: Whether the node's horovod has the fix from ``patches/``.
        pid: The worker's process id.
        niceness: The worker's niceness (Ray starts its workers at 15 by default).
        lowest_niceness: The lowest niceness the worker may take (``priority``).
    """

    node_id: str
    node_ip: str
    node_ip_iface: str | None
    loopback_iface: str | None
    interfaces: tuple[str, ...]
    gpu_ids: tuple[str, ...] = ()
    hostname: str = ""
    hostname_address: str | None = None
    gloo_iface_fixed: bool = True
    pid: int = 0
    niceness: int = 0
    lowest_niceness: int = 0

    @property
    def where(self) -> str:
        """ "on node <id> (<ip>, pid <pid>)", for messages."""
        return f"on node {self.node_id[:12]} ({self.node_ip}, pid {self.pid})"


def local_interfaces() -> dict[str, list[str]]:
    """This machine's network interfaces: name -> its IPv4 addresses."""
    import psutil

    return {
        name: [addr.address for addr in addrs if addr.family == socket.AF_INET]
        for name, addrs in psutil.net_if_addrs().items()
    }


def interface_holding(interfaces: Mapping[str, list[str]], address: str) -> str | None:
    """The interface that holds ``address``, None if no interface does."""
    return next((name for name, addrs in interfaces.items() if address in addrs), None)


def hostname_address() -> str | None:
    """The address a Gloo device without an interface takes: the host name's first one.

    Mirrors Gloo's own lookup (getaddrinfo on gethostname(), the first address that binds).
    """
    try:
        candidates = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, address in candidates:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((address[0], 0))
        except OSError:
            continue
        return address[0]
    return None


def choose_iface(nics: Sequence[str], interfaces: Iterable[str]) -> str | None:
    """The first interface in ``nics`` that a node with ``interfaces`` has, else None."""
    present = set(interfaces)
    return next((name for name in nics if name in present), None)


def gloo_ifaces(
    nodes: Sequence[NodeFacts], nics: Sequence[str] | None, local_job: bool
) -> list[str]:
    """The interface each node's ranks give Gloo (``HOROVOD_GLOO_IFACE``), in order.

    With ``nics``, the first of them each node has; without, loopback for a job that runs
    wholly on one node, else the interface that holds the node's Ray address.

    Raises:
        ConfigError: Some nodes have none of ``nics``; names each, with what it has.
        HorovodRayError: No interface holds a node's Ray address.
    """
    if not nics:
        return [_default_iface(node, local_job) for node in nodes]
    chosen = [choose_iface(nics, node.interfaces) for node in nodes]
    lacking = {
        f"node {n.node_ip} ({n.node_id[:12]}) has {list(n.interfaces)}": None
        for n, iface in zip(nodes, chosen, strict=True)
        if iface is None
    }
    if lacking:
        raise ConfigError(
            "nics",
            f"nics={list(nics)}: some nodes have none of these interfaces: "
            + "; ".join(lacking)
            + ". Add one each of them has to nics (each node uses the first it has), "
            "or leave nics unset",
        )
    return chosen


def gloo_iface(node: NodeFacts, nics: Sequence[str] | None, local_job: bool) -> str:
    """The interface the ranks on ``node`` give Gloo; see :func:`gloo_ifaces`."""
    return gloo_ifaces([node], nics, local_job)[0]


def _default_iface(node: NodeFacts, local_job: bool) -> str:
    iface = node.loopback_iface if local_job else node.node_ip_iface
    if iface is None:
        raise HorovodRayError(
            f"found no network interface holding {node.node_ip} on node "
            f"{node.node_id[:12]} (it has {list(node.interfaces)}); pass nics=['<interface>'] "
            f"to create_settings"
        )
    return iface


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def hostname_problem(node: NodeFacts, local_job: bool) -> str | None:
    """Why a stock horovod's collectives would fail on ``node``, None when they would not.

    Without the fix in ``patches/``, horovod's collectives bind Gloo to the address of the
    host's name, whatever ``HOROVOD_GLOO_IFACE`` says. Peers on other hosts cannot reach a
    loopback address (the '127.0.1.1 <hostname>' line Debian and Ubuntu write), and a name
    that does not resolve stops Gloo outright. A job on one node only uses loopback anyway.
    """
    if local_job or node.gloo_iface_fixed:
        return None
    address = node.hostname_address
    if address is not None and not _is_loopback(address):
        return None
    resolved = "does not resolve" if address is None else f"resolves to {address}"
    return (
        f"node {node.node_ip} ({node.node_id[:12]}): its host name "
        f"{node.hostname!r} {resolved}, and the installed horovod binds its collectives "
        f"to that address, which ranks on other hosts cannot reach"
    )


def check_hostnames(nodes: Iterable[NodeFacts], local_job: bool) -> None:
    """Refuses a job that a stock horovod would break on a host name (see above).

    Raises:
        HorovodRayError: Naming each such node and the two fixes.
    """
    problems = dict.fromkeys(
        p for node in nodes if (p := hostname_problem(node, local_job)) is not None
    )
    if problems:
        raise HorovodRayError(
            "this job spans hosts, and Gloo would fail on:\n  "
            + "\n  ".join(problems)
            + f"\nTo fix: {PATCH_HINT}."
        )
