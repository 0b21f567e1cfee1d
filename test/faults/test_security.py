"""Security: a fresh secret per job, never at import, never shown; no key files; the
rendezvous serves only the job's workers, and only requests that carry the job's secret."""

from __future__ import annotations

import http.client
import importlib
import logging
import os

import pytest

from horovod_ray import RayExecutor
from test.conftest import run_fresh_python, start_local_ray

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def job():
    start_local_ray(4)
    with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2) as executor:
        yield executor


def _request(address, method, path, body=None, source="127.0.0.1"):
    conn = http.client.HTTPConnection(*address, timeout=5, source_address=(source, 0))
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _worker_addr(job) -> str:
    return job.execute_single(lambda _: os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"])


def test_each_job_gets_its_own_secret_only_through_the_workers_env(job):
    host, port = job.rendezvous_address
    addr = _worker_addr(job)
    # The store URL horovod builds is http://ADDR:PORT/<scope>/<key>, so the secret
    # rides in the path: http://host:port/<secret>:PORT/<scope>/<key>.
    assert addr.startswith(f"{host}:{port}/")
    secret = addr.split("/", 1)[1]
    assert len(secret) >= 32
    with RayExecutor(num_workers=1) as other:
        assert _worker_addr(other).split("/", 1)[1] != secret
    assert secret not in repr(job) and secret not in str(vars(job))


def test_the_secret_is_not_made_at_import_time():
    code = (
        "import os, secrets\n"
        "calls = []\n"
        "for name in ('token_urlsafe', 'token_hex', 'token_bytes'):\n"
        "    original = getattr(secrets, name)\n"
        "    setattr(secrets, name, lambda *a, _o=original: calls.append(a) or _o(*a))\n"
        "urandom = os.urandom\n"
        "import horovod_ray, horovod_ray.tune, horovod_ray.rendezvous.server\n"
        "print('CALLS', len(calls))\n"
        "from horovod_ray.rendezvous.server import RendezvousServer\n"
        "server = RendezvousServer('127.0.0.1', {'127.0.0.1'})\n"
        "print('AFTER_INIT', len(calls))\n"
    )
    out = run_fresh_python(code, timeout_s=120)
    assert "CALLS 0" in out
    assert "AFTER_INIT 0" in out  # made only when a job's server starts


def test_the_secret_is_never_logged(caplog):
    start_local_ray(4)
    with caplog.at_level(logging.DEBUG, logger="horovod_ray"):
        with RayExecutor(num_workers=2) as executor:
            secret = _worker_addr(executor).split("/", 1)[1]
            executor.run(lambda: None)
    assert caplog.records, "the executor logged nothing at DEBUG"
    assert all(secret not in record.getMessage() for record in caplog.records)


def test_requests_without_the_secret_are_refused(job):
    address = job.rendezvous_address
    secret = _worker_addr(job).split("/", 1)[1]
    port = address[1]
    assert _request(address, "GET", "/global/0")[0] == 403
    assert _request(address, "PUT", "/global/9", body=b"x")[0] == 403
    assert _request(address, "GET", f"/wrong-{secret[6:]}:{port}/global/0")[0] == 403
    assert _request(address, "GET", f"/{secret}:{port}/global/9")[0] == 404


def test_other_source_addresses_get_403_and_change_nothing(job):
    address = job.rendezvous_address
    secret = _worker_addr(job).split("/", 1)[1]
    path = f"/{secret}:{address[1]}/global/77"
    assert _request(address, "PUT", path, body=b"evil", source="127.0.0.2")[0] == 403
    assert _request(address, "GET", path)[0] == 404
    # The job still works after all this.
    assert job.run(lambda: 3) == [3, 3]


def test_the_rendezvous_binds_loopback_for_a_local_job(job):
    assert job.rendezvous_address[0] == "127.0.0.1"


def test_no_key_file_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    settings_module = importlib.import_module("horovod_ray.settings")
    monkeypatch.setattr(settings_module, "_ssh_warned", False)
    before = set(os.listdir("/tmp"))
    RayExecutor.create_settings(ssh_identity_file=str(tmp_path / "id_rsa"), ssh_str="PRIVATE")
    assert list(tmp_path.iterdir()) == []
    assert not any(
        "PRIVATE" in open(os.path.join("/tmp", name), errors="ignore").read()
        for name in set(os.listdir("/tmp")) - before
        if os.path.isfile(os.path.join("/tmp", name))
    )


# Opens N connections to ADDR:PORT from SOURCE and sends each a megabyte of request head
# that never ends (no secret, no blank line), as fast as the server takes it, then holds
# them HOLD seconds. Prints the bytes the server took in.
_FLOOD = """
import socket, sys, time
host, port, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
count, hold = int(sys.argv[4]), float(sys.argv[5])
head = b"GET /no-secret/global/0 HTTP/1.1\\r\\nX-Pad: " + b"x" * (1 << 20)
socks, sent = [], 0
for _ in range(count):
    try:
        sock = socket.create_connection((host, port), timeout=2, source_address=(source, 0))
    except OSError:
        continue
    sock.setblocking(False)
    socks.append([sock, 0])
deadline = time.monotonic() + hold
while time.monotonic() < deadline:
    for entry in socks:
        sock, done = entry
        if done < len(head):
            try:
                entry[1] += sock.send(head[done:done + 65536])
            except (BlockingIOError, OSError):
                pass
    time.sleep(0.01)
print(sum(done for _, done in socks), len(socks))
"""


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def test_a_flood_of_megabyte_heads_holds_little_memory_and_the_job_goes_on(job):
    """400 connections without the secret (300 from a worker node's address, 100 from a
    stranger's), a megabyte of head each: the server used to keep each up to 1 MiB for
    10 s (2,000 raised its memory by 944 MiB). It now reads 16 KiB of a head at most."""
    import subprocess
    import sys
    import threading

    from test.horovod_identity import horovod_identity

    host, port = job.rendezvous_address
    baseline, peak, sampling = _rss(), [0], threading.Event()

    def sample():
        while not sampling.is_set():
            peak[0] = max(peak[0], _rss())
            sampling.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    floods = [
        subprocess.Popen(
            [sys.executable, "-c", _FLOOD, host, str(port), source, str(count), "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for source, count in (("127.0.0.1", 300), ("127.0.0.2", 100))
    ]
    try:
        outputs = [flood.communicate(timeout=60)[0].split() for flood in floods]
    finally:
        for flood in floods:
            flood.kill()
        sampling.set()
        sampler.join()
    sent = sum(int(taken) for taken, _ in outputs)
    connected = sum(int(count) for _, count in outputs)
    assert connected >= 300, outputs
    assert sent >= 50 * (1 << 20), outputs  # the server did take the flood in
    growth_mib = (peak[0] - baseline) / (1 << 20)
    assert growth_mib < 64, f"{growth_mib:.0f} MiB for {sent / (1 << 20):.0f} MiB sent"
    # The ranks' first Horovod call: a real rendezvous, after the flood.
    assert {r["sum"] for r in job.run(horovod_identity)} == {3.0}
