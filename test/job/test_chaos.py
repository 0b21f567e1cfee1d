"""Chaos for an elastic job on a real multi-node Ray cluster: horovod.ray's TestDiscovery
hides Ray nodes and shows them again on a timer while a horovod.torch loop trains."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from horovod_ray import RayExecutor
from horovod_ray.elastic import TestDiscovery
from test.conftest import same_on_every_rank, shut_down_own_ray, start_cluster
from test.elastic_training import Heard, progress, train

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    """A 0-CPU head and three 2-CPU nodes: a 2-CPU rank on each. The nodes share this
    machine's address, so RayHostDiscovery names each by its node id."""
    cluster = start_cluster([0, 2, 2, 2])
    yield cluster
    shut_down_own_ray()


def _until(condition, timeout_s: float, what: str, run: threading.Thread) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert run.is_alive(), f"run() ended while waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("graceful", [True, False], ids=["graceful", "forceful"])
def test_an_elastic_job_trains_on_through_test_discoverys_changes(cluster, tmp_path, graceful):
    """min_hosts=2, max_hosts=3 over three 1-slot hosts: every 5 s one is hidden (3
    offered) or shown again (2 offered), so the world shrinks and grows as it trains. The
    run is ended a few steps after the world shrank while training: one state on every
    rank, every step once, each allreduce summing the world it ran on. Graceful: the
    ranks of a hidden host leave at a commit, nothing is rolled back. Forceful: they are
    killed, and the survivors roll back (a step begun twice); cooldown_range lets a
    killed host back in, so that each later hide also finds ranks to kill."""
    discovery = TestDiscovery(
        min_hosts=2,
        max_hosts=3,
        change_frequency_s=5,
        cpus_per_slot=2,
        _graceful=graceful,
        seed=3,
    )
    executor = RayExecutor(
        RayExecutor.create_settings(timeout_s=30),
        min_workers=1,
        max_workers=3,
        cpus_per_worker=2,
        elastic_timeout=60,
        cooldown_range=(1, 2),
        override_discovery=discovery,
    )
    executor.start()
    heard, outcome = Heard(), {}

    def target() -> None:
        try:
            outcome["results"] = executor.run(train, args=(str(tmp_path),), callbacks=[heard])
        except BaseException as err:  # noqa: BLE001 - read by the test
            outcome["error"] = err

    run = threading.Thread(target=target, daemon=True)
    run.start()
    largest = [0]

    def shrank() -> bool:
        size = progress(tmp_path)[1]
        largest[0] = max(largest[0], size)
        return size < largest[0]

    try:
        _until(lambda: progress(tmp_path)[0] >= 2, 120, "training", run)
        _until(shrank, 60, "the world to shrink while training", run)
        shrunk_at = progress(tmp_path)[0]
        _until(lambda: progress(tmp_path)[0] >= shrunk_at + 3, 60, "steps after it", run)
        (tmp_path / "finish").touch()
        run.join(120)
    finally:
        executor.stop()
    assert not run.is_alive(), "run() did not end"
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert [(r["rank"], r["size"]) for r in results] == [
        (i, len(results)) for i in range(len(results))
    ]
    history = same_on_every_rank(results, "history")
    same_on_every_rank(results, "weights")  # the new ranks took the survivors' state
    assert [step for step, _, _ in history] == list(range(len(history)))  # each step once
    assert all(total == size for _, size, total in history)  # the allreduce saw everyone
    sizes = [size for _, size, _ in history]
    assert any(later < earlier for earlier, later in itertools.pairwise(sizes)), sizes
    # The world changed because the discovery hid a host: its node left the world.
    hid = {change.host for change in discovery.changes if change.hidden}
    removed = {node for change in heard.changes for node in change["nodes_removed"]}
    assert hid & removed, (discovery.changes, heard.changes)
    if graceful:
        assert all(change.num_killed == 0 for change in discovery.changes)
        for result in results:  # nothing rolled back: each step begun once
            assert len(result["begun"]) == len(set(result["begun"])), result["begun"]
    else:
        # The ranks killed took none of their steps with them: the history above has each
        # step once. (Whether a survivor then began a step again depends on where the kill
        # found it: in a collective, or between two.)
        assert any(change.num_killed >= 1 for change in discovery.changes), discovery.changes
