"""The ranks' niceness (rank/priority) on real ranks: the note, every thread's, and a
niceness the ranks may not take. The pure parts: test_priority.py."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import subprocess
import sys
import threading

import pytest

from horovod_ray import RayExecutor

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


def test_ranks_at_a_lowered_priority_are_named_once_with_the_fix(
    ray_4cpu, no_leaks, caplog, monkeypatch
):
    from horovod_ray.rank import priority

    monkeypatch.setattr(priority, "_noted", False)
    # The tests' Ray starts its workers at Ray's default niceness.
    with caplog.at_level(logging.INFO, logger="horovod_ray.rank.priority"):
        for _ in range(2):
            with RayExecutor(SETTINGS, num_workers=2) as executor:
                niceness = executor.run(lambda: os.nice(0))
    assert niceness == [15, 15]
    noted = [r.getMessage() for r in caplog.records if "niceness" in r.getMessage()]
    assert noted == [
        f"the ranks run at niceness 15 (Ray's worker_niceness), behind every other process "
        f"of their node; {priority.HINT}, or create_settings(niceness=0) where the ranks "
        f"may raise their priority"
    ]
    assert "RAY_worker_niceness=0 ray start" in noted[0]


def _thread_nicenesses() -> list[int]:
    """Every thread's niceness in this rank, one started now included."""

    done = threading.Event()
    later = threading.Thread(target=done.wait)
    later.start()
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
        return [os.getpriority(os.PRIO_PROCESS, tid) for tid in tids]
    finally:
        done.set()
        later.join()


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering Ray's niceness needs root")
def test_a_niceness_asked_for_is_taken_by_every_thread_of_every_rank(
    ray_4cpu, no_leaks, caplog, monkeypatch
):
    from horovod_ray.rank import priority

    monkeypatch.setattr(priority, "_noted", False)
    settings = RayExecutor.create_settings(timeout_s=60, verbose=0, niceness=0)
    # Ray's workers here run at 15; the tests run as root, which may lower it.
    with caplog.at_level(logging.INFO, logger="horovod_ray.rank.priority"):
        with RayExecutor(settings, num_workers=2) as executor:
            ranks = executor.run(_thread_nicenesses)
    for threads in ranks:
        assert len(threads) > 5  # Ray's threads too, not only the caller's
        assert set(threads) == {0}
    # Nothing to advise: the user chose.
    assert [r for r in caplog.records if r.name == "horovod_ray.rank.priority"] == []


_UNPRIVILEGED_START = """
import json
import ray
from ray.util import state
from horovod_ray import ConfigError, RayExecutor

ray.init(address="local", num_cpus=2, log_to_driver=False)  # the state API needs the dashboard
address = ray.get_runtime_context().gcs_address
executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, niceness=0), num_workers=2)
try:
    executor.start()
    outcome = {"started": True}
except ConfigError as err:
    outcome = {"parameter": err.parameter, "message": str(err), "state": executor.state.value}
alive = state.list_actors(address=address, filters=[("state", "=", "ALIVE")])
groups = ray.util.placement_group_table().values()
outcome["alive"] = len(alive)
outcome["groups"] = sorted({group["state"] for group in groups})
ray.shutdown()
print(json.dumps(outcome))
"""


def _can_drop_sys_nice() -> bool:
    """Whether setpriv can take CAP_SYS_NICE away here (it needs CAP_SETPCAP), leaving a
    process that may not lower its niceness at all (RLIMIT_NICE 0)."""
    from horovod_ray.rank import priority

    cap_setpcap = 8
    with open("/proc/self/status") as status:
        has_setpcap = priority.has_capability(status.read(), cap_setpcap)
    return (
        shutil.which("setpriv") is not None
        and has_setpcap
        and resource.getrlimit(resource.RLIMIT_NICE)[0] == 0
    )


@pytest.mark.skipif(not _can_drop_sys_nice(), reason="needs setpriv, CAP_SETPCAP, RLIMIT_NICE 0")
def test_a_niceness_the_ranks_may_not_take_fails_the_start_and_releases_everything():
    import json

    # A driver, and so its Ray and ranks, without CAP_SYS_NICE: the ranks run at Ray's
    # 15 and may not lower it.
    drop = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--"]
    result = subprocess.run(
        [*drop, sys.executable, "-c", _UNPRIVILEGED_START],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["parameter"] == "niceness"
    assert outcome["message"].startswith("niceness=0 is out of reach for 2 rank(s)")
    assert "it runs at 15 and may go no lower than 15" in outcome["message"]
    assert outcome["state"] == "failed"
    assert outcome["alive"] == 0 and outcome["groups"] == ["REMOVED"]
