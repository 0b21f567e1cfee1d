"""The rendezvous under a flood: unauthenticated megabyte request heads at a live job.

``python -m bench.tools.flood`` starts a local Ray and a 2-rank job, then, several times: opens
the flood's connections (from a worker node's address without the secret, and from a
stranger's address), sends each a megabyte of request head that never ends, and holds
them; meanwhile it samples the driver's memory and times a real rank's request (a GET
with the job's secret) against the same request without a flood. Then the ranks do their
first rendezvous and allreduce. See docs/benchmarks.rst, "Reliability".

:func:`flood` is the flood itself, which test/faults/test_security.py uses too.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

# Opens COUNT connections to HOST:PORT from SOURCE and sends each a megabyte of request head
# that never ends (no secret, no blank line), as fast as the server takes it, then holds
# them HOLD seconds. Prints the bytes the server took in and the connections it accepted.
_CLIENT = """
import socket, sys, time
host, port, source = sys.argv[1], int(sys.argv[2]), sys.argv[3]
count, hold = int(sys.argv[4]), float(sys.argv[5])
head = b"GET /no-secret/global/0 HTTP/1.1\\r\\nX-Pad: " + b"x" * (1 << 20)
socks = []
for _ in range(count):
    try:
        sock = socket.create_connection((host, port), timeout=2, source_address=(source, 0))
    except OSError:
        continue
    sock.setblocking(False)
    socks.append([sock, 0])
print("connected", flush=True)
deadline = time.monotonic() + hold
while time.monotonic() < deadline:
    for entry in socks:
        sock, done = entry
        if done < len(head):
            try:
                entry[1] += sock.send(head[done:done + 65536])
            except OSError:
                pass
    time.sleep(0.01)
print(sum(done for _, done in socks), len(socks))
"""

# (source address, connections): a worker node's address without the secret, a stranger's.
SOURCES = (("127.0.0.1", 300), ("127.0.0.2", 100))
HOLD_S = 3.0


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Flood:
    """The flood's client processes, started together; :meth:`wait` returns (bytes the
    server took in, connections it accepted), summed over the sources."""

    def __init__(self, address: tuple[str, int], hold_s: float) -> None:
        host, port = address
        self._processes = [
            subprocess.Popen(
                [sys.executable, "-c", _CLIENT, host, str(port), source, str(count), str(hold_s)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for source, count in SOURCES
        ]
        for process in self._processes:  # every connection is open before anyone is timed
            process.stdout.readline()

    def wait(self, timeout_s: float = 120) -> tuple[int, int]:
        sent = connected = 0
        try:
            for process in self._processes:
                taken, count = process.communicate(timeout=timeout_s)[0].split()
                sent, connected = sent + int(taken), connected + int(count)
        finally:
            for process in self._processes:
                process.kill()
        return sent, connected


def flood(
    address: tuple[str, int], hold_s: float = 3.0, meanwhile: Callable[[], None] | None = None
) -> dict:
    """Floods the server at ``address`` while sampling this process's memory; once every
    connection is open, starts ``meanwhile`` on a thread of its own (it should return
    when the flood is over: by ``hold_s``).

    Returns:
        ``sent_bytes``, ``connections`` and ``growth_bytes``: the peak of this process's
        resident memory during the flood, above what it was before.
    """
    baseline, peak, done = rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            done.wait(0.02)

    threads = [threading.Thread(target=sample)]
    threads[0].start()
    try:
        running = Flood(address, hold_s)
        if meanwhile is not None:
            threads.append(threading.Thread(target=meanwhile))
            threads[-1].start()
        sent, connected = running.wait()
    finally:
        done.set()
        for thread in threads:
            thread.join()
    return {"sent_bytes": sent, "connections": connected, "growth_bytes": peak[0] - baseline}


def _answer_ms(address: tuple[str, int], path: str) -> float:
    """One authenticated GET, as a rank asks: milliseconds until its answer is read."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("GET", path)
        conn.getresponse().read()
    finally:
        conn.close()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    # Here, not at the top: bench.harness.common sets Ray's environment, which the test suite,
    # importing flood(), must not inherit.
    from bench.cases import workloads
    from bench.harness import common
    from horovod_ray import RayExecutor, local_ray

    local_ray.start(num_cpus=common.NUM_CPUS, log_to_driver=False)
    try:
        with RayExecutor(RayExecutor.create_settings(verbose=0), num_workers=2) as job:
            address = job.rendezvous_address
            secret = job.execute_single(lambda _: os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"])
            path = "/" + secret.split("/", 1)[1] + f":{address[1]}/global/0"
            quiet = [_answer_ms(address, path) for _ in range(20)]
            figures = []
            for _ in range(args.reps):
                during: list[float] = []

                def ask(during: list[float] = during) -> None:
                    deadline = time.monotonic() + HOLD_S
                    while time.monotonic() < deadline:
                        during.append(_answer_ms(address, path))
                        time.sleep(0.05)

                figures.append((flood(address, HOLD_S, ask), statistics.median(during)))
            job.run(workloads.first_allreduce)
        print(f"a real rank's GET, no flood: {statistics.median(quiet):.2f} ms (median of 20)")
        for result, during_ms in figures:
            print(
                f"flood: {result['connections']} connections, "
                f"{result['sent_bytes'] / 2**20:.0f} MiB sent; the driver's memory "
                f"+{result['growth_bytes'] / 2**20:.1f} MiB at its peak; a real rank's GET "
                f"{during_ms:.2f} ms (median)"
            )
        print("the ranks' first rendezvous and allreduce after the floods: done")
    finally:
        local_ray.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
