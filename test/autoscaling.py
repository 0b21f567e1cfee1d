"""What a cloud does to a Ray cluster, on this machine: a node drained before a
preemption (:func:`drain_node`), and a cluster whose worker nodes Ray's own autoscaler
launches and removes: ``ray start --head`` with Ray's fake multi-node provider, each
"node" an extra raylet. ``ray.cluster_utils.AutoscalingCluster`` would do it, but the
installed Ray lacks the config file it reads, and its start first stops every Ray
instance on the machine.
This one is started in a session of its own and ended by the pids of that session:
nothing else is touched."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import ray._private.services

RAY = Path(sys.executable).parent / "ray"


def standing_request() -> list[dict]:
    """Ray's standing autoscaler request (``request_resources``), read as the autoscaler
    (v1, this suite's) reads it."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def drain_node(gcs_address: str, node_id: str, deadline_s: float | None) -> None:
    """Drains a node as a cloud integration does before a spot preemption (the call behind
    ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``). Ray then schedules nothing
    new there; a node with nothing left on it exits."""
    from ray.core.generated import autoscaler_pb2

    deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
    accepted, why = ray._raylet.GcsClient(address=gcs_address).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "a test preempts it",
        deadline_ms,
    )
    assert accepted, why


def alive_worker_nodes() -> int:
    """The alive nodes with CPUs (the heads of these tests have none)."""
    return sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU"))


CONFIG = """\
cluster_name: horovod-ray-test
max_workers: {max_nodes}
upscaling_speed: 1.0
idle_timeout_minutes: {idle_minutes}
provider:
  type: fake_multinode
  use_node_id_as_ip: true
  disable_node_updaters: true
  disable_launch_config_check: true
  gcs_address: "{gcs_address}"
auth:
  ssh_user: ubuntu
available_node_types:
  ray.head.default:
    resources: {{CPU: 0}}
    node_config: {{}}
    max_workers: 0
  ray.worker.cpu:
    resources: {{CPU: {cpus_per_node}}}
    node_config: {{}}
    min_workers: 0
    max_workers: {max_nodes}
head_node_type: ray.head.default
file_mounts: {{}}
cluster_synced_files: []
file_mounts_sync_continuously: false
rsync_exclude: []
rsync_filter: []
initialization_commands: []
setup_commands: []
head_setup_commands: []
worker_setup_commands: []
head_start_ray_commands: []
worker_start_ray_commands: []
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _session_of(pid: int) -> int | None:
    """The session of a live process (None for one gone, or a zombie: it holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, _, _, session = stat.rpartition(")")[2].split()[:4]  # fields 3 to 6
    return None if state == "Z" else int(session)


class AutoscalingCluster:
    """A head without CPUs and up to ``max_nodes`` nodes of ``cpus_per_node`` CPUs, which
    the autoscaler launches on demand and removes after ``idle_minutes`` idle."""

    def __init__(
        self, folder: Path, max_nodes: int = 3, cpus_per_node: int = 2, idle_minutes=0.1
    ) -> None:
        self.folder = folder
        self.address = f"{ray._private.services.get_node_ip_address()}:{_free_port()}"
        self._config = CONFIG.format(
            max_nodes=max_nodes,
            idle_minutes=idle_minutes,
            gcs_address=self.address,
            cpus_per_node=cpus_per_node,
        )
        self._session: int | None = None
        # Short: Ray's socket paths under it must stay within 107 bytes.
        self._temp_dir = tempfile.mkdtemp(prefix="hr-as-", dir="/tmp")
        # Drivers of this cluster need the same: the head started without token auth.
        self.env = {**os.environ, "RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "disabled"}

    def __enter__(self) -> AutoscalingCluster:
        config = self.folder / "autoscaler.yaml"
        config.write_text(self._config)
        env = {**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        del env["RAY_ADDRESS"]
        argv = [
            str(RAY), "start", "--head", f"--port={self.address.rpartition(':')[2]}",
            "--num-cpus=0", "--num-gpus=0", f"--autoscaling-config={config}",
            f"--temp-dir={self._temp_dir}", "--include-dashboard=false",
            "--disable-usage-stats",
        ]  # fmt: skip
        # Its own session: every process Ray starts for it (and for the nodes the
        # autoscaler launches) stays in it, whatever its process title becomes.
        start = subprocess.Popen(
            argv, env=env, start_new_session=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self._session = start.pid
        try:
            out, _ = start.communicate(timeout=120)
            if start.returncode != 0:
                raise RuntimeError(f"ray start failed:\n{out}")
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ raises
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def pids(self) -> list[int]:
        """Every live process of the cluster's session."""
        if self._session is None:
            return []
        return [
            int(entry)
            for entry in os.listdir("/proc")
            if entry.isdigit() and _session_of(int(entry)) == self._session
        ]

    def stop(self) -> None:
        """Kills every process of the cluster, by pid, and waits until none is left."""
        deadline = time.monotonic() + 30
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        assert not self.pids(), f"left behind: {self.pids()}"
        shutil.rmtree(self._temp_dir, ignore_errors=True)
