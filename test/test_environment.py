"""The stack works end to end, before any horovod_ray code: horovod has Gloo, and two
Ray actors given Horovod's Gloo environment by hand run a real TensorFlow allreduce."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import ray
from horovod.runner.http.http_server import RendezvousServer

from test.conftest import ROOT, horovod_gloo


def test_horovod_was_built_with_gloo_and_tensorflow():
    # Importing horovod.tensorflow loads its TensorFlow extension, or raises. (horovod's
    # extension_available() checks in a child process and reads the answer without
    # waiting for it: it failed once in CI on a busy machine.)
    import horovod.tensorflow as hvd

    assert hvd.gloo_built()


def _tcp_connections() -> set[tuple]:
    """This process's TCP connections, as (local, remote) address pairs, in any state."""
    import psutil

    return {
        (tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process().net_connections("tcp") if c.raddr
    }


@ray.remote(num_cpus=1)
class _HandMadeRank:
    def allreduce(self, env: dict) -> tuple[int, int, float]:
        os.environ.update(env)
        import horovod.torch as hvd
        import torch

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)] * 3), op=hvd.Sum)
        return hvd.rank(), hvd.size(), float(total[0])

    def connections(self) -> set[tuple]:
        return _tcp_connections()

    def shutdown(self) -> set[tuple]:
        import horovod.torch as hvd

        hvd.shutdown()
        return _tcp_connections()


def _gloo_env(rank: int, size: int, port: int) -> dict[str, str]:
    """Horovod's Gloo environment for one rank of ``size``, all on this machine."""
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank),
        "HOROVOD_LOCAL_SIZE": str(size),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "host",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
    }


def _hand_made_job(size: int, port: int) -> list:
    """``size`` actors that have joined one Horovod job and done an allreduce."""
    ranks = [_HandMadeRank.remote() for _ in range(size)]
    results = ray.get(
        [actor.allreduce.remote(_gloo_env(rank, size, port)) for rank, actor in enumerate(ranks)]
    )
    assert results == [(rank, size, size * (size + 1) / 2) for rank in range(size)]
    return ranks


@pytest.mark.timeout(120)
def test_two_ray_actors_allreduce_through_horovod_gloo(ray_4cpu):
    server = RendezvousServer()
    port = server.start()
    try:
        for actor in _hand_made_job(2, port):
            ray.kill(actor)
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_horovod_shutdown_closes_every_gloo_connection(ray_4cpu):
    """patches/horovod-0.28.1-gloo-process-set-finalize.patch: without it, a rank keeps
    its process set's Gloo connections after ``hvd.shutdown()``, until its next init. In
    an elastic reset, a survivor blocked in a receive from a rank that has already
    reset then waits out the whole Gloo timeout instead of failing at once."""
    server = RendezvousServer()
    port = server.start()
    ranks = []
    try:
        ranks = _hand_made_job(2, port)
        mine = ray.get([actor.connections.remote() for actor in ranks])
        # A Gloo pair: a connection from one rank's process to the other's.
        pairs = [
            {
                (local, remote)
                for local, remote in mine[rank]
                if remote in {p[0] for p in mine[1 - rank]}
            }
            for rank in range(2)
        ]
        assert all(pairs), mine  # the ranks are connected to each other
        after = ray.get([actor.shutdown.remote() for actor in ranks])
        assert [pairs[rank] & after[rank] for rank in range(2)] == [set(), set()]
    finally:
        for actor in ranks:
            ray.kill(actor)
        server.stop()


def test_gloo_turns_an_unexpected_message_into_an_error_not_an_abort(tmp_path):
    """patches/horovod-0.28.1-gloo-unexpected-message.patch: without it, a message larger
    than the receive posted for it (two ranks out of step, as an elastic survivor can be
    right after a peer's node goes) makes Gloo's device thread throw, and the process
    aborts. With it, that connection closes and the receive raises, like any I/O error."""
    from horovod_ray.stack.build import _extension_has

    library, flags = horovod_gloo()
    program = tmp_path / "gloo_unexpected_message"
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-pthread", *flags]
        + [str(ROOT / "test/native/gloo_unexpected_message.cc"), str(library), "-o", str(program)],
        check=True,
        timeout=120,
    )
    done = subprocess.run([program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("raised: ") and "Unexpected message from " in done.stdout
    # The library tested here is the one compiled into the installed extension.
    assert _extension_has(b"Unexpected message from ")
