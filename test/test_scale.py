"""The rendezvous at scale (patches/horovod-0.28.1-rendezvous-batched.patch).

Real ranks rendezvous in O(1) requests each; the scale harness (bench/cases/scale.py) sends
what real ranks send, so its figures for thousands of ranks stand for real ranks."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import ray

from bench.cases import scale
from horovod_ray.rank.assignment import RankInfo
from horovod_ray.rendezvous.server import BATCH_ENV, GLOBAL_SCOPE, RendezvousServer, worker_env
from test.conftest import start_local_ray

pytestmark = pytest.mark.timeout(300)
SIZE = 4


def _server(requests: list) -> RendezvousServer:
    """A server that records (method, scope, key, status) of every request it answers."""

    def record(method: str, scope: str, key: str, status: int, nbytes: int) -> None:
        requests.append((method, scope, key, status))

    server = RendezvousServer("127.0.0.1", {"127.0.0.1"}, trace=record)
    server.start([RankInfo(rank, SIZE, rank, SIZE, 0, 1, "host") for rank in range(SIZE)])
    return server


@ray.remote(num_cpus=0)
class _Rank:
    def init_and_allreduce(self, env: dict) -> float:
        os.environ.update(env)
        import horovod.torch as hvd
        import torch

        hvd.init()
        total = float(hvd.allreduce(torch.tensor(float(hvd.rank())), op=hvd.Sum))
        hvd.shutdown()
        return total


def _real_ranks(batched: bool) -> list[tuple[str, str, str, int]]:
    """The requests ``SIZE`` real horovod ranks (Ray actors) send for hvd.init()."""
    requests: list = []
    server = _server(requests)
    env = {
        **worker_env(server),
        "HOROVOD_SIZE": str(SIZE),
        "HOROVOD_LOCAL_SIZE": str(SIZE),
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "1",
        "HOROVOD_HOSTNAME": "host",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
    }
    if not batched:
        del env[BATCH_ENV]
    ranks = [_Rank.remote() for _ in range(SIZE)]
    try:
        totals = ray.get(
            [
                actor.init_and_allreduce.remote(
                    {**env, "HOROVOD_RANK": str(rank), "HOROVOD_LOCAL_RANK": str(rank)}
                )
                for rank, actor in enumerate(ranks)
            ],
            timeout=240,
        )
    finally:
        for actor in ranks:
            ray.kill(actor)
        server.stop()
    assert totals == [float(sum(range(SIZE)))] * SIZE
    return requests


def _harness(batched: bool) -> list[tuple[str, str, str, int]]:
    requests: list = []
    server = _server(requests)
    try:
        result = scale.run_against(server, SIZE, batched, deadline_s=60)
    finally:
        server.stop()
    assert (result["done"], result["failed"], result["wrong"]) == (SIZE, 0, 0)
    return requests


def _global(requests: list) -> list[tuple[str, str]]:
    # Answered requests only: a batched get held past its hold is asked again (404).
    return sorted(
        (method, key)
        for method, scope, key, status in requests
        if scope == GLOBAL_SCOPE and (status == 200 or method != "POST")
    )


@pytest.fixture(scope="module")
def harness_binary():
    return scale.build_harness()


@pytest.fixture(scope="module")
def batched_requests() -> list[tuple[str, str, str, int]]:
    """What real ranks send with the patch's batched rendezvous: one job for both tests."""
    start_local_ray(4)
    return _real_ranks(batched=True)


def test_real_ranks_rendezvous_in_a_few_requests_each(batched_requests):
    """Without the patch every rank PUTs its host name and address list and GETs every
    peer's key, polling until it exists: O(N^2) requests per scope. With it, per rank
    and scope: one batched set, one batched get held until its keys are there, and
    horovod's closing DELETE."""
    from horovod_ray.stack.build import batched_rendezvous

    assert batched_rendezvous()  # what `make install` reports
    by_scope: dict[str, Counter] = {}
    for method, scope, key, status in batched_requests:
        by_scope.setdefault(scope, Counter())[(method, "N" if key.isdigit() else key, status)] += 1
    # hvd.init() meets in the global, local and cross scopes, then again in each for
    # the global process set.
    assert {scope.split("_process_set_")[0] for scope in by_scope} == {
        GLOBAL_SCOPE,
        "local_host",
    } | {f"cross_{rank}" for rank in range(SIZE)}
    for scope, seen in by_scope.items():
        members = 1 if scope.startswith("cross_") else SIZE
        seen.pop(("POST", "_mget", 404), None)  # asked again after a hold: timing
        assert seen == {
            ("POST", "_mset", 200): members,
            ("POST", "_mget", 200): members,
            ("DELETE", "N", 200): members,
        }, scope


def test_the_harness_sends_what_real_ranks_send(ray_4cpu, batched_requests, harness_binary):
    """The scale harness runs horovod's client code from the build tree; here its
    requests in the global scope are checked against real ranks', both ways."""
    batched = _global(batched_requests)
    assert batched == _global(_harness(batched=True))
    # Gloo's per-key sequence polls (GETs of keys not there yet) as often as timing
    # makes it: the same requests, a timing-dependent number of times.
    per_key = _global(_real_ranks(batched=False))
    assert ("PUT", "rank_0") in per_key and ("GET", "3") in per_key
    assert sorted(set(per_key)) == sorted(set(_global(_harness(batched=False))))
