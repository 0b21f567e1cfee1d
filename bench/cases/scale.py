"""The rendezvous at scale: N ranks' ``hvd.init`` store traffic against our server.

``python -m bench.run --only scale``. bench/tools/rendezvous_load.cc runs N ranks as
threads, each doing what one real rank does in Gloo's global scope, with horovod's own
client code from the build tree (see that file). Each N runs three ways, back to back:

* ``stock``: horovod's own ``RendezvousHTTPServer`` (what horovodrun and horovod.ray
  serve: a thread per request, the stdlib's listen backlog of 5) and Gloo's per-key
  sequence, as in horovod 0.28.1;
* ``backlog``: our server (a kernel-sized backlog) and the same per-key sequence;
* ``batched``: our server and the batched requests of
  patches/horovod-0.28.1-rendezvous-batched.patch, what horovod_ray's ranks send.

A run still going at the deadline is recorded with the deadline as its seconds and
``finished: false``. Requests and bytes are counted by the server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import threading
from pathlib import Path
from typing import Sequence

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rendezvous.server import GLOBAL_SCOPE, RendezvousServer
from horovod_ray.stack.build import installed_version

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "bench" / "tools" / "rendezvous_load.cc"
BINARY = ROOT / "build" / "rendezvous_load"
SIZES = (64, 256, 1024, 4096)
WAYS = ("stock", "backlog", "batched")


def _tensorflow_version() -> str:
    version = installed_version("tensorflow-cpu", "tensorflow")
    if version is None:
        raise RuntimeError("TensorFlow is not installed: run `make install`")
    return version


def horovod_tree() -> tuple[Path, Path]:
    """horovod's patched source tree and CMake build folder that ``make install`` made for
    this environment's TensorFlow line (``build/tf2.21``, ``build/tf2.15``)."""
    line = ".".join(_tensorflow_version().split(".")[:2])
    builds = sorted(ROOT.glob(f"build/tf{line}/horovod-*/build/temp.*/*"))
    if not builds:
        raise RuntimeError(f"no horovod build tree under build/tf{line}: run `make install`")
    build = builds[0]
    return build.parent.parent.parent, build


def build_harness() -> Path:
    """Compiles the harness against horovod's build tree (once per build of it)."""
    source, build = horovod_tree()
    # Gloo as horovod's TensorFlow extension links it (built for TensorFlow's C++ ABI).
    link = (build / "horovod/tensorflow/CMakeFiles/tensorflow.dir/link.txt").read_text()
    library = build / "horovod/tensorflow" / re.search(r"(\S*gloo\S*\.a)", link).group(1)
    if BINARY.exists() and BINARY.stat().st_mtime > max(
        library.stat().st_mtime, SOURCE.stat().st_mtime
    ):
        return BINARY
    # Compiled exactly as horovod's TensorFlow extension compiles these files.
    flags_make = (build / "horovod/tensorflow/CMakeFiles/tensorflow.dir/flags.make").read_text()
    flags = shlex.split(
        " ".join(re.findall(r"^CXX_(?:DEFINES|INCLUDES|FLAGS) = (.*)$", flags_make, re.M))
    )
    compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [compiler, *flags, "-I", str(source), "-O2", "-o", str(BINARY), str(SOURCE)]
        + [
            str(source / "horovod/common" / name)
            for name in ("gloo/http_store.cc", "logging.cc", "common.cc")
        ]
        + [str(library), "-pthread"],
        check=True,
        timeout=300,
    )
    return BINARY


class _Counter:
    """Requests and answer bytes a server sent, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += nbytes

    def trace(self, method: str, scope: str, key: str, status: int, nbytes: int) -> None:
        self.add(nbytes)


def _counting(base: type, counter: _Counter) -> type:
    """horovod's handler, counting what it answers."""

    class Counting(base):
        def handle_one_request(self) -> None:
            self._body_bytes = 0
            super().handle_one_request()
            if self.raw_requestline:
                counter.add(self._body_bytes)

        def send_header(self, keyword: str, value: str) -> None:
            if keyword == "Content-Length":
                self._body_bytes = int(value)
            super().send_header(keyword, value)

    return Counting


def _stock_server(size: int, counter: _Counter):
    """horovod 0.28.1's server as horovodrun starts it (loopback only, no secret)."""
    server = RendezvousHTTPServer(("127.0.0.1", 0), _counting(RendezvousHandler, counter), False)
    server.scope_size[GLOBAL_SCOPE] = size
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return ("127.0.0.1", server.server_address[1]), "127.0.0.1", stop


def _our_server(size: int, counter: _Counter):
    server = RendezvousServer("127.0.0.1", {"127.0.0.1"}, trace=counter.trace)
    address = server.start([_rank(rank, size) for rank in range(size)])
    return address, server.worker_address, server.stop


def _rank(rank: int, size: int) -> RankInfo:
    # One host, as the harness's ranks all name the same one.
    return RankInfo(rank, size, rank, size, 0, 1, "simulated-host")


def _harness(worker_address: str, port: int, size: int, batched: bool, deadline_s: float):
    done = subprocess.run(
        [str(build_harness()), "--addr", worker_address, "--port", str(port)]
        + ["--size", str(size), "--batched", "1" if batched else "0"]
        + ["--timeout-s", str(deadline_s), "--deadline-s", str(deadline_s)],
        capture_output=True,
        text=True,
        timeout=deadline_s + 120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"rendezvous_load failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_against(server: RendezvousServer, size: int, batched: bool, deadline_s: float) -> dict:
    """The harness's ``size`` ranks against a started server of ours (see module doc)."""
    return _harness(server.worker_address, server.address[1], size, batched, deadline_s)


def run_once(size: int, way: str, deadline_s: float) -> dict:
    """One rendezvous of ``size`` ranks; its seconds, requests and megabytes served."""
    counter = _Counter()
    start = _stock_server if way == "stock" else _our_server
    address, worker_address, stop = start(size, counter)
    try:
        result = _harness(worker_address, address[1], size, way == "batched", deadline_s)
    finally:
        stop()
    if result["wrong"]:
        raise RuntimeError(f"{result['wrong']} ranks read an address not meant for them")
    return {**result, "requests": counter.requests, "mbytes": counter.bytes / 1e6}


def measure(reps: int, deadline_s: float, sizes=SIZES, ways=WAYS) -> dict:
    """``scale_*`` figures: medians over ``reps`` runs per (N, way), ways alternating."""
    runs: dict[str, dict[int, list[dict]]] = {way: {n: [] for n in sizes} for way in ways}
    for size in sizes:
        for rep in range(reps):
            order = list(ways[rep % len(ways) :] + ways[: rep % len(ways)])
            for way in order:
                # The per-key sequence is O(N^2) requests: past the first bound it only
                # measures the bound again.
                if way != "batched" and any(not r["finished"] for r in _smaller(runs[way], size)):
                    continue
                result = run_once(size, way, deadline_s)
                runs[way][size].append(result)
                print(
                    f"  N={size:<5} {way:<8} {result['seconds']:8.2f}s"
                    f"{'' if result['finished'] else ' (bound)'}"
                    f"  {result['requests']:>9} requests  {result['mbytes']:10.1f} MB"
                    f"  failed {result['failed']}",
                    flush=True,
                )

    def med(way: str, key: str) -> dict:
        return {str(n): statistics.median(r[key] for r in rs) for n, rs in runs[way].items() if rs}

    def bound(way: str) -> dict:
        return {str(n): all(r["finished"] for r in rs) for n, rs in runs[way].items() if rs}

    figures = {
        "scale_deadline_s": deadline_s,
        "scale_by_way": {
            way: {
                "seconds": med(way, "seconds"),
                "finished": bound(way),
                "requests": med(way, "requests"),
                "mbytes": med(way, "mbytes"),
                "runs": {str(n): rs for n, rs in runs[way].items() if rs},
            }
            for way in ways
        },
    }
    main = "batched" if "batched" in ways else ways[0]
    figures["scale_rendezvous_s"] = med(main, "seconds")
    figures["scale_rendezvous_finished"] = bound(main)
    figures["scale_requests"] = med(main, "requests")
    figures["scale_mbytes"] = med(main, "mbytes")
    return figures


def _smaller(runs: dict[int, list[dict]], size: int) -> list[dict]:
    return [r for n, rs in runs.items() if n < size for r in rs]


def plot(figures: dict, directory: Path) -> str:
    """Seconds against N, both axes log, beside O(N^2) and O(N^3) lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for way, data in figures["scale_by_way"].items():
        sizes = sorted(int(n) for n in data["seconds"])
        if not sizes:
            continue
        seconds = [data["seconds"][str(n)] for n in sizes]
        ax.plot(sizes, seconds, marker="o", label=way)
        for n, s in zip(sizes, seconds, strict=True):
            if not data["finished"][str(n)]:
                ax.annotate("bound", (n, s), textcoords="offset points", xytext=(4, 4))
    batched = figures["scale_by_way"].get("batched", {}).get("seconds", {})
    if batched:
        n0 = min(int(n) for n in batched)
        s0 = batched[str(n0)]
        xs = [n0, max(int(n) for n in batched)]
        ax.plot(xs, [s0 * (x / n0) ** 2 for x in xs], "k--", lw=0.8, label="O(N^2)")
        ax.plot(xs, [s0 * (x / n0) ** 3 for x in xs], "k:", lw=0.8, label="O(N^3)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("rendezvous of one scope (s)")
    ax.set_title("Gloo rendezvous of N ranks against one server")
    ax.legend()
    fig.tight_layout()
    name = "scale_rendezvous.png"
    fig.savefig(directory / name, dpi=100)
    plt.close(fig)
    return name


# --------------------------------------------------------------------------- real ranks


def _import_tensorflow() -> None:
    import horovod.tensorflow  # noqa: F401
    import tensorflow  # noqa: F401


def _hvd_init(batched: bool) -> None:
    import horovod.tensorflow as hvd

    from horovod_ray.rendezvous.server import BATCH_ENV

    # Read by horovod at each hvd.init(): "0" sends Gloo's own per-key sequence, as a
    # build without the batching patch does.
    os.environ[BATCH_ENV] = "1" if batched else "0"
    hvd.init()


def _first_allreduce_then_shutdown() -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    total = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum))
    hvd.shutdown()
    return total


def start_path_once(
    num_workers: int, num_hosts: int, ways: Sequence[str] = ("batched", "per_key")
) -> dict[str, dict[str, float]]:
    """One job of ``num_workers`` real ranks on ``num_hosts`` Ray nodes of the running
    cluster: seconds of each step of its start; then ``hvd.init`` of all ranks started
    together (TensorFlow already imported: the rendezvous is what is measured) and the
    first allreduce, once each way (batched, per key) in that order, in that job."""
    import time

    from horovod_ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=300, placement_group_timeout_s=300)
    executor = RayExecutor(
        settings, num_hosts=num_hosts, num_workers_per_host=num_workers // num_hosts
    )
    try:
        began = time.perf_counter()
        executor.start()
        steps = {"start": time.perf_counter() - began, **executor._now.kind.start_s}
        executor.run(_import_tensorflow)
        measured = {}
        for way in ways:
            began = time.perf_counter()
            executor.run(_hvd_init, args=[way == "batched"])
            rendezvous_s = time.perf_counter() - began
            began = time.perf_counter()
            totals = executor.run(_first_allreduce_then_shutdown)
            collective_s = time.perf_counter() - began
            if totals != [float(num_workers)] * num_workers:
                raise RuntimeError(f"allreduce of ones over {num_workers} ranks gave {totals}")
            measured[way] = {**steps, "rendezvous": rendezvous_s, "first_collective": collective_s}
    finally:
        executor.shutdown()
    return measured


def start_path(sizes: Sequence[int], reps: int, num_hosts: int = 2) -> dict:
    """``scale_start_s``: {N: {step: median seconds}} on ``num_hosts`` simulated nodes,
    with the batched rendezvous; ``scale_start_per_key_s`` the same with Gloo's."""
    from bench.harness.common import simulated_nodes, wait_for_quiet

    figures: dict[str, dict] = {"batched": {}, "per_key": {}}
    with simulated_nodes([max(sizes) // num_hosts] * num_hosts):
        for size in sizes:
            runs: dict[str, list[dict]] = {"batched": [], "per_key": []}
            for rep in range(reps):
                wait_for_quiet()
                ways = ("batched", "per_key") if rep % 2 == 0 else ("per_key", "batched")
                for way, steps in start_path_once(size, num_hosts, ways).items():
                    runs[way].append(steps)
                    print(
                        f"  N={size:<3} {way:<8} "
                        + "  ".join(f"{k} {v:.2f}s" for k, v in steps.items()),
                        flush=True,
                    )
            for way, steps_list in runs.items():
                figures[way][str(size)] = {
                    step: statistics.median(p[step] for p in steps_list) for step in steps_list[0]
                }
    return {"scale_start_s": figures["batched"], "scale_start_per_key_s": figures["per_key"]}
