"""Simulated hosts: network namespaces joined by a bridge, each a Ray node of its own.

Every host is a network namespace with its own address on a private /24 that exists only
inside the namespaces made here, loopback up, its own host name (a UTS namespace per
command) and its own /etc/hosts (a private mount namespace per command), so nothing of the
machine's network, name or files changes. The bridge lives in a namespace of its own too:
the machine's own network namespace never sees a link or an address of the harness.

Ray runs inside the hosts with ``ray start --node-ip-address=...``, one temp dir per host;
drivers run inside a host the same way. Teardown ends every process in the harness's
namespaces by pid (``ip netns pids``), then deletes the namespaces (their links go with
them) and the temp dirs. It never calls ``ray stop``: other Ray instances on the machine
are not ours.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
# Ray's own ports inside each namespace; no other Ray can be there.
GCS_PORT = 6379
CLIENT_PORT = 10001
DASHBOARD_PORT = 8265


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here, None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the '{tool}' command"
    probe = f"hrprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclasses.dataclass
class Host:
    """One simulated host."""

    name: str
    netns: str
    address: str
    iface: str
    hostname: str
    hosts_file: Path
    temp_dir: Path
    ray_node: bool = False
    # An empty folder mounted over the checkout in this host's commands: a machine that
    # never saw it (None: the checkout is there).
    hides_repo: Path | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host: its network, host name and /etc/hosts (and no
        checkout, where the host hides it)."""
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        if self.hides_repo is not None:
            hide = f"mount --bind {shlex.quote(str(self.hides_repo))} {shlex.quote(str(REPO))}"
            script = script.replace(" && shift", f" && {hide} && shift")
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", script, self.hostname, str(self.hosts_file), *argv,
        ]  # fmt: skip

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True
        ).stdout
        return [int(pid) for pid in out.split()]


# Names of the harness's namespaces and temp dirs: hr<pid><letter>-...
_NAME = re.compile(r"^hr(\d+)[a-z]-")


def sweep_stale() -> list[str]:
    """Removes what harnesses of processes that are gone left behind (a killed pytest).

    Only names of this harness's pattern whose creating process no longer runs: their
    processes are ended by pid, then the namespaces and temp dirs removed.
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    dirs = [str(p) for p in Path("/tmp").glob("hr*-*")]
    swept = []
    for name in names + dirs:
        match = _NAME.match(Path(name).name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        if name in dirs:
            shutil.rmtree(name, ignore_errors=True)
        else:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                _kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        swept.append(name)
    return swept


class SimHosts:
    """A set of simulated hosts on one bridge; use as a context manager.

    Args:
        subnet: The first three octets of the hosts' /24 (a private range).
        venv_bin: The virtualenv whose ``ray`` and ``python`` the hosts run (this one's
            by default).
        in_repo: Whether the hosts' commands see the checkout (``PYTHONPATH``, and as
            their working directory); without it they run in the harness's folder with
            an empty folder mounted over the checkout, as on a machine that never saw it.
    """

    _made = 0  # harnesses made by this process, so that each gets names of its own

    def __init__(
        self, subnet: str = "10.213.7", venv_bin: Path = VENV_BIN, in_repo: bool = True
    ) -> None:
        self.subnet = subnet
        self.venv_bin, self.in_repo = venv_bin, in_repo
        SimHosts._made += 1
        self.tag = f"hr{os.getpid()}{chr(ord('a') + SimHosts._made % 26)}"
        self.root = Path("/tmp") / f"{self.tag}-hosts"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.head: Host | None = None
        self._made_netns: list[str] = []
        self._networks: dict[str, str] = {}  # bridge name -> subnet
        # Host name -> its address on a second network, where a harness adds one.
        self.second_network: dict[str, str] = {}

    def __enter__(self) -> SimHosts:
        try:
            self.root.mkdir()
            self._add_netns(self.switch)
            self._add_bridge("br0", self.subnet)
        except BaseException:
            self.close()
            raise
        return self

    def _add_bridge(self, bridge: str, subnet: str) -> None:
        _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", bridge, "up")
        self._networks[bridge] = subnet

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made_netns.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str, iface: str = "eth0", loopback_hostname: bool = False) -> Host:
        """Adds a host with its own address, interface name and host name.

        Args:
            name: Short name; the host name is ``<name>.sim``.
            iface: Its interface's name (``eth0``, ``ens5``, ...).
            loopback_hostname: Its /etc/hosts maps its own name to 127.0.1.1, as Debian
                and Ubuntu write it.
        """
        index = len(self.hosts) + 1
        netns = f"{self.tag}-{name}"
        self._add_netns(netns)
        address = self._plug(netns, index, "br0", iface)
        host = Host(
            name=name,
            netns=netns,
            address=address,
            iface=iface,
            hostname=f"{name}.sim",
            hosts_file=self.root / f"{name}.hosts",
            temp_dir=self.root / name,
            hides_repo=None if self.in_repo else self.root / "empty",
        )
        host.temp_dir.mkdir()
        if host.hides_repo is not None:
            host.hides_repo.mkdir(exist_ok=True)
        self.hosts[name] = host
        own = "127.0.1.1" if loopback_hostname else address
        host.hosts_file.write_text(f"127.0.0.1 localhost\n::1 localhost\n{own} {host.hostname}\n")
        self._write_peer_names()
        return host

    def _plug(self, netns: str, index: int, bridge: str, iface: str) -> str:
        """Links ``netns`` to ``bridge`` through ``iface``; returns the address it got."""
        port = f"{bridge}p{index}"  # the bridge's end, inside the switch's namespace
        _ip("-n", self.switch, "link", "add", port, "type", "veth",
            "peer", "name", iface, "netns", netns)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", bridge)
        _ip("-n", self.switch, "link", "set", port, "up")
        address = f"{self._networks[bridge]}.{index}"
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", iface)
        _ip("-n", netns, "link", "set", iface, "up")
        return address

    def add_network(self, bridge: str, subnet: str, ifaces: dict[str, str]) -> dict[str, str]:
        """A second network: a bridge joining some hosts through interfaces of their own.

        Args:
            bridge: The new bridge's name (``br1``, ...).
            subnet: Its /24's first three octets.
            ifaces: Host name -> the name its interface on this network gets.

        Returns:
            Host name -> its address on this network.
        """
        self._add_bridge(bridge, subnet)
        index = {name: i for i, name in enumerate(self.hosts, start=1)}
        return {
            name: self._plug(self.hosts[name].netns, index[name], bridge, iface)
            for name, iface in ifaces.items()
        }

    def port_command(self, bridge: str, host: str, up: bool) -> list[str]:
        """The command that takes ``host``'s port on ``bridge`` down (or up again): a
        silent partition, as a pulled cable. Frames are dropped both ways and nothing is
        reset; the hosts' other networks go on."""
        index = list(self.hosts).index(host) + 1
        state = "up" if up else "down"
        return ["ip", "-n", self.switch, "link", "set", "dev", f"{bridge}p{index}", state]

    def _write_peer_names(self) -> None:
        for host in self.hosts.values():
            lines = host.hosts_file.read_text().splitlines()[:3]
            lines += [f"{h.address} {h.hostname}" for h in self.hosts.values() if h is not host]
            host.hosts_file.write_text("\n".join(lines) + "\n")

    # ----------------------------------------------------------------------- Ray

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env.pop("PYTHONPATH", None)
        env.update(
            PATH=f"{self.venv_bin}:{env.get('PATH', '/usr/bin:/bin')}",
            RAY_AUTH_MODE="disabled",
            RAY_USAGE_STATS_ENABLED="0",
            TF_CPP_MIN_LOG_LEVEL="2",
        )
        if self.in_repo:
            env["PYTHONPATH"] = str(REPO)
        return env

    def start_ray(
        self, host: Host, num_cpus: int, head: bool = False, dashboard: bool = True
    ) -> None:
        """``ray start`` on ``host``: the head (first) or a node joining it.

        The head serves Ray Client on port 10001 and, with ``dashboard``, the dashboard
        (and so Ray Jobs) on port 8265 of its address.
        """
        argv = [str(self.venv_bin / "ray"), "start", f"--node-ip-address={host.address}",
                f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={host.temp_dir}",
                "--disable-usage-stats"]  # fmt: skip
        if head:
            argv += ["--head", f"--port={GCS_PORT}", f"--ray-client-server-port={CLIENT_PORT}",
                     f"--include-dashboard={str(dashboard).lower()}",
                     f"--dashboard-host={host.address}",
                     f"--dashboard-port={DASHBOARD_PORT}"]  # fmt: skip
            self.head = host
        else:
            argv += [f"--address={self.gcs_address}"]
        result = subprocess.run(
            host.command(argv),
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=180,
            cwd=REPO if self.in_repo else self.root,
        )
        if result.returncode != 0:
            raise RuntimeError(f"ray start on {host.name} failed:\n{result.stderr[-3000:]}")
        host.ray_node = True

    def wait_for_nodes(self, timeout_s: float = 120) -> None:
        """Waits until the live nodes are exactly one per Ray host, each at its address.

        A crashed host's node stays "alive" until Ray's health checks give up on it, so a
        restarted host is only ready once its old node is gone and its new one is there.
        """
        wanted = sorted(h.address for h in self.hosts.values() if h.ray_node)
        code = (
            "import ray, sys, time\n"
            f"ray.init(address={self.gcs_address!r}, log_to_driver=False)\n"
            f"deadline = time.time() + {timeout_s}\n"
            "alive = lambda: sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])\n"
            f"while alive() != {wanted!r}:\n"
            "    assert time.time() < deadline, ray.nodes()\n"
            "    time.sleep(0.5)\n"
        )
        self.python(self.head, ["-c", code], timeout_s=timeout_s + 60)

    def python(
        self, host: Host, args: Sequence[str], timeout_s: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Runs the venv's Python on ``host`` and waits for it."""
        result = subprocess.run(
            host.command([str(self.venv_bin / "python"), *args]),
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO if self.in_repo else self.root,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"python {' '.join(args)[:200]} on {host.name} exited {result.returncode}:\n"
                f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
            )
        return result

    def scenario(self, host: Host, name: str, timeout_s: float = 300, **params) -> dict:
        """Runs ``scenarios.py NAME`` on ``host`` as the driver; returns its JSON result."""
        params.setdefault("hosts", {h.name: dataclasses.asdict(h) for h in self.hosts.values()})
        params.setdefault("gcs_address", self.gcs_address)
        payload = json.dumps(params, default=str)
        script = str(Path(__file__).with_name("scenarios.py"))
        result = self.python(host, [script, name, payload], timeout_s=timeout_s)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"scenario {name} printed no result:\n{result.stdout[-3000:]}"
        outcome = json.loads(lines[-1][len("RESULT ") :])
        assert "exception" not in outcome, f"scenario {name} raised:\n{outcome['exception']}"
        return outcome

    def crash(self, host: Host) -> None:
        """Ends every process on ``host`` at once, as a host that loses power."""
        for pid in host.pids():
            _kill(pid, signal.SIGKILL)
        host.ray_node = False

    # ------------------------------------------------------------------- cleanup

    def close(self) -> None:
        """Ends every process in the harness's namespaces, then removes what it made."""
        for host in self.hosts.values():
            for pid in host.pids():
                _kill(pid, signal.SIGTERM)
        # A short grace: terminated all at once, Ray's GCS, raylets and monitor wait on
        # one another for about 10 s before they exit; nothing of theirs outlives the
        # namespaces and the folder removed below.
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(h.pids() for h in self.hosts.values()):
            time.sleep(0.2)
        # Again until none is left: a process may fork while the last ones are killed.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(h.pids() for h in self.hosts.values()):
            for host in self.hosts.values():
                for pid in host.pids():
                    _kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for netns in reversed(self._made_netns):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self._made_netns.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of the harness is still on the machine (empty after close)."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        found = [line.split()[0] for line in listed.splitlines() if line.startswith(self.tag)]
        found += [f"pid {pid}" for host in self.hosts.values() for pid in host.pids()]
        if self.root.exists():
            found.append(str(self.root))
        return found


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
