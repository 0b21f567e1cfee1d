"""Driver programs for the simulated-hosts tests, run on a simulated host.

``python scenarios.py NAME PARAMS_JSON`` connects to the harness's Ray cluster, runs one
scenario and prints ``RESULT <json>`` for the test to check. Run as ``__main__``, so the
functions sent to the ranks travel by value and the cluster needs nothing of this file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable

import ray

import horovod_ray
from horovod_ray import RayExecutor

SCENARIOS: dict[str, Callable[[dict], dict]] = {}


def scenario(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def rank_facts() -> dict:
    """What a rank knows of itself after one allreduce: identity, interface, peers."""
    import socket

    import psutil

    from test.horovod_identity import horovod_identity

    facts = horovod_identity()
    links = [
        [c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port]
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr
    ]
    return {
        **facts,
        "hostname": socket.gethostname(),
        "iface": os.environ["HOROVOD_GLOO_IFACE"],
        "links": links,
    }


def peer_links(facts: list[dict]) -> list[list]:
    """The TCP connections between two ranks of the job: Gloo's pairs.

    A connection is a pair when one rank's (local, remote) is another rank's (remote,
    local); Ray's own connections to raylets and the GCS never are.
    """
    ends = {}
    for fact in facts:
        for lip, lport, rip, rport in fact["links"]:
            ends[(lip, lport, rip, rport)] = fact["rank"]
    pairs = []
    for (lip, lport, rip, rport), rank in ends.items():
        peer = ends.get((rip, rport, lip, lport))
        if peer is not None and peer != rank and rank < peer:
            pairs.append([rank, lip, peer, rip])
    return pairs


# The harness's GCS: the state API would otherwise look for Ray instances on this machine
# and stop at any other one running beside the harness.
_GCS_ADDRESS = ""


def cluster_state() -> dict:
    """Actors alive and placement groups not removed, to check that nothing leaked."""
    from ray.util import state

    actors = state.list_actors(
        address=_GCS_ADDRESS,
        filters=[("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )
    groups = state.list_placement_groups(address=_GCS_ADDRESS, raise_on_missing_output=False)
    return {
        "alive_actors": [a.class_name for a in actors],
        "live_groups": [g.placement_group_id for g in groups if g.state != "REMOVED"],
    }


def settle() -> dict:
    """Cluster state once what a job released has gone (Ray confirms asynchronously)."""
    deadline = time.monotonic() + 20
    current = cluster_state()
    while (current["alive_actors"] or current["live_groups"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        current = cluster_state()
    return current


@scenario
def spread(params: dict) -> dict:
    """One job over hosts (spread, or named: ``named_hosts``); each rank's identity,
    interface and Gloo peer addresses."""
    if "named_hosts" in params:
        size = {"hosts": [tuple(pair) for pair in params["named_hosts"]]}
    else:
        size = {"num_hosts": params["num_hosts"], "num_workers_per_host": params["num_slots"]}
    with RayExecutor(
        RayExecutor.create_settings(timeout_s=60, nics=params.get("nics")), **size
    ) as executor:
        facts = executor.run(rank_facts)
        nodes = [rank.node_id for rank in executor.ranks]
        rendezvous = executor.rendezvous_address
    return {
        "facts": facts,
        "pairs": peer_links(facts),
        "nodes": nodes,
        "rendezvous": list(rendezvous),
        "after": settle(),
    }


@scenario
def expect_error(params: dict) -> dict:
    """A job that must fail to start: the error, and what it left behind."""
    before = cluster_state()
    try:
        horovod_ray.run(
            rank_facts, num_hosts=params["num_hosts"], num_slots=1, nics=params.get("nics")
        )
    except horovod_ray.HorovodRayError as err:
        error = {"type": type(err).__name__, "text": str(err)}
        error["parameter"] = getattr(err, "parameter", None)
    else:
        error = None
    return {"error": error, "before": before, "after": settle()}


def probe(netns: str, url: str) -> str:
    """GET ``url`` from inside a simulated host; the HTTP status, or the error's name."""
    code = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        "    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or out.stderr.strip()[-200:]


@scenario
def refusals(params: dict) -> dict:
    """A 2-host job's rendezvous server, asked from everywhere while the job runs."""
    hosts = params["hosts"]
    by_name = {h["hostname"]: h for h in hosts.values()}
    # Fill the outsider's CPUs, so that the job takes the driver's host and the other one.
    outsider = hosts[params["outsider"]]
    filler = ray.util.placement_group([{"CPU": 2, f"node:{outsider['address']}": 0.01}])
    ray.get(filler.ready(), timeout=60)
    with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2) as executor:
        # One call: Horovod joined (the store holds rank 0's key), hosts, the secret.
        facts = executor.run(
            lambda: {**rank_facts(), "addr": os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]}
        )
        secret_addr = facts[0]["addr"]
        host, port = executor.rendezvous_address
        job_hosts = [by_name[f["hostname"]] for f in facts]
        job_ips = {h["address"] for h in job_hosts}
        with_secret = f"http://{secret_addr}:{port}/global/0"
        without = f"http://{host}:{port}/global/0"
        worker_host = next(h for h in job_hosts if h["address"] != host)
        assert outsider["address"] not in job_ips
        stranger = next(h for h in hosts.values() if not h["ray_node"])
        answers = {
            "job node, secret": probe(worker_host["netns"], with_secret),
            "job node, no secret": probe(worker_host["netns"], without),
            "other Ray node, secret": probe(outsider["netns"], with_secret),
            "not a Ray node, secret": probe(stranger["netns"], with_secret),
        }
    ray.util.remove_placement_group(filler)
    return {"rendezvous": [host, port], "answers": answers, "job_ips": sorted(job_ips)}


@scenario
def node_lost(params: dict) -> dict:
    """A host dies mid-job (every process on it killed): who is named, how fast."""
    victim = params["hosts"][params["victim"]]
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=3)
    executor.start()

    def train() -> None:
        import horovod.torch as hvd
        import torch

        hvd.init()
        hvd.allreduce(torch.tensor(1.0))
        horovod_ray.log({"in_loop": True})  # the driver crashes the host on this
        while True:
            hvd.allreduce(torch.tensor(1.0))

    victim_ranks = [
        f["rank"] for f in executor.run(rank_facts) if f["hostname"] == victim["hostname"]
    ]
    killed_at: list[float] = []

    def crash_victim() -> None:
        out = subprocess.run(
            ["ip", "netns", "pids", victim["netns"]], capture_output=True, text=True
        )
        killed_at.append(time.monotonic())
        for pid in out.stdout.split():
            os.kill(int(pid), 9)

    crasher = threading.Thread(target=crash_victim)

    def on_log(item: dict) -> None:
        if not crasher.is_alive() and not killed_at:
            crasher.start()

    error: dict[str, Any] = {}
    try:
        executor.run(train, callbacks=[on_log])
    except horovod_ray.WorkerFailedError as err:
        error = {"failures": sorted(err.failures), "text": str(err)}
    except horovod_ray.HorovodRayError as err:
        error = {"type": type(err).__name__, "text": str(err)}
    if crasher.ident is not None:
        crasher.join()
    seconds = time.monotonic() - killed_at[0] if killed_at else None
    state = executor.state.value
    executor.stop()
    return {
        "victim_ranks": victim_ranks,
        "error": error,
        "seconds": seconds,
        "state": state,
    }


@scenario
def partition(params: dict) -> dict:
    """The network Gloo uses (nics: the second one) stops carrying anything to one host
    mid-job, while Ray's own stays up: no connection is reset, every rank waits inside a
    collective. What the caller is told, and when."""
    settings = RayExecutor.create_settings(timeout_s=params["gloo_timeout_s"], nics=["ib1", "ib0"])
    executor = RayExecutor(settings, num_hosts=3)
    executor.start()

    def train() -> None:
        import horovod.torch as hvd
        import torch

        hvd.init()
        hvd.allreduce(torch.tensor(1.0))
        horovod_ray.log({"in_loop": True})  # the driver cuts the network on this
        deadline = time.monotonic() + 120  # a cut that never took ends the job all the same
        while time.monotonic() < deadline:
            hvd.allreduce(torch.tensor(1.0), name="loop")

    cut_at: list[float] = []

    def on_log(item: dict) -> None:
        if not cut_at:
            subprocess.run(params["cut"], check=True)
            cut_at.append(time.monotonic())

    error: dict[str, Any] = {}
    try:
        executor.run(train, callbacks=[on_log])
    except horovod_ray.WorkerFailedError as err:
        error = {
            "type": type(err).__name__,
            "failures": sorted(err.failures),
            "text": str(err),
            "missing": list(getattr(err, "missing", [])),
            "waiting": list(getattr(err, "waiting", [])),
        }
    finally:
        subprocess.run(params["heal"], check=True)
    seconds = time.monotonic() - cut_at[0] if cut_at else None
    state = executor.state.value
    executor.stop()
    return {"error": error, "seconds": seconds, "state": state, "after": settle()}


@scenario
def client(params: dict) -> dict:
    """Ray Client from a machine that is no Ray node: run(), RayExecutor and Tune."""
    from ray import tune

    from horovod_ray.tune import DistributedTrainableCreator

    out: dict[str, Any] = {"connected": ray.util.client.ray.is_connected()}
    out["run"] = horovod_ray.run(rank_facts, num_hosts=2, num_slots=1)
    with RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2) as executor:
        out["rendezvous"] = list(executor.rendezvous_address)
        out["sizes"] = executor.run(lambda: os.environ["HOROVOD_SIZE"])
        out["single"] = executor.execute_single(lambda _: "rank 0")
        logged: list = []
        executor.run(lambda: horovod_ray.log({"hello": 1}), callbacks=[logged.append])
        out["logged"] = logged

    def train(config: dict) -> None:
        import horovod.torch as hvd
        import torch

        hvd.init()
        tune.report({"loss": float(hvd.allreduce(torch.tensor(config["x"])))})

    trainable = DistributedTrainableCreator(train, num_hosts=2, num_slots=1)
    results = tune.Tuner(
        trainable,
        param_space={"x": 0.5},
        run_config=tune.RunConfig(storage_path=params["storage"], verbose=0),
    ).fit()
    out["tune_loss"] = results.get_best_result(metric="loss", mode="min").metrics["loss"]
    out["tune_errors"] = results.num_errors
    out["after"] = settle()
    return out


@scenario
def allreduce_seconds(params: dict) -> dict:
    """The bench's B6: B1's timed allreduce loop, one rank on each of two hosts."""
    from bench.cases import workloads

    settings = RayExecutor.create_settings(timeout_s=120, verbose=0)
    with RayExecutor(settings, num_hosts=2) as executor:
        seconds = executor.run(
            workloads.allreduce_throughput,
            args=[params["bytes"], params["iters"], params["warmup"]],
        )
    return {"seconds": seconds[0]}


@scenario
def elastic_host_lost(params: dict) -> dict:
    """An elastic job over three hosts (six ranks) loses one host and goes on with four."""
    import tempfile

    from test.elastic_training import Heard, train

    victim = params["hosts"][params["victim"]]
    folder = tempfile.mkdtemp(prefix="hr-elastic-")

    def progress() -> tuple[int, int]:
        try:
            step, size = open(os.path.join(folder, "progress")).read().split()
            return int(step), int(size)
        except (FileNotFoundError, ValueError):
            return 0, 0

    def wait_until(step: int, size: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not (progress()[0] >= step and progress()[1] == size):
            if time.monotonic() > deadline or not runner.is_alive():
                raise AssertionError(f"no step {step} on {size} ranks: {progress()} {outcome}")
            time.sleep(0.2)

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, min_workers=2, max_workers=6, elastic_timeout=120)
    executor.start()
    heard = Heard()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["results"] = executor.run(train, args=(folder,), callbacks=[heard])
        except Exception as err:  # noqa: BLE001 - reported
            outcome["error"] = repr(err)

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    try:
        wait_until(3, 6, 240)
        pids = subprocess.run(
            ["ip", "netns", "pids", victim["netns"]], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            os.kill(int(pid), 9)
        lost_at = time.monotonic()
        wait_until(progress()[0] + 3, 4, 240)
        shrink_s = time.monotonic() - lost_at
        open(os.path.join(folder, "finish"), "w").close()
        runner.join(120)
    finally:
        executor.stop()
        shutil.rmtree(folder, ignore_errors=True)  # the ranks' progress files
    results = outcome.get("results") or []
    return {
        "error": outcome.get("error"),
        "sizes": [e["size_after"] for e in heard.changes],
        "history": results[0]["history"] if results else [],
        "ranks": [r["rank"] for r in results],
        "shrink_s": shrink_s,
    }


# Ray Client connections tried before a scenario gives up (see main).
CONNECT_ATTEMPTS = 4


def main() -> int:
    global _GCS_ADDRESS
    name, params = sys.argv[1], json.loads(sys.argv[2])
    _GCS_ADDRESS = params["gcs_address"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    address = params.get("ray_address") or params["gcs_address"]
    for attempt in range(CONNECT_ATTEMPTS):
        try:
            ray.init(address=address, log_to_driver=False)
            break
        except ConnectionAbortedError as err:
            # Ray Client's proxy starts a server process per client; on a loaded machine
            # that process has exited at once ("SpecificServer startup failed", twice in a
            # row once). That is Ray's setup, not what is tested.
            if attempt == CONNECT_ATTEMPTS - 1:
                raise
            print(f"Ray Client connection failed, trying again: {err}", file=sys.stderr)
            time.sleep(1)
    try:
        result = SCENARIOS[name](params)
    except Exception:  # noqa: BLE001 - the test shows the traceback
        result = {"exception": traceback.format_exc()}
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
