"""The ranks' niceness: what a process may take, the driver's check, the rank's side.

No Ray here; ``test_niceness.py`` sets real ranks' niceness.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys

import pytest

from horovod_ray import ConfigError
from horovod_ray.rank import priority
from horovod_ray.rank.network import NodeFacts

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


@pytest.mark.parametrize(
    "niceness,cap,rlimit,lowest",
    [
        (15, False, 0, 15),  # no privilege: only up from where it is
        (15, False, 20, 0),  # RLIMIT_NICE 20: down to 20 - 20
        (15, False, 25, -5),
        (15, False, 40, -20),
        (15, False, 99, -20),  # clamped to Linux's range
        (15, False, resource.RLIM_INFINITY, -20),
        (15, True, 0, -20),  # CAP_SYS_NICE (root)
        (0, False, 0, 0),
        (0, False, 10, 0),  # a limit above where it is gives nothing more
    ],
)
def test_lowest_allowed_niceness(niceness, cap, rlimit, lowest):
    assert priority.lowest_allowed(niceness, cap, rlimit) == lowest


@pytest.mark.parametrize(
    "cap_eff,has",
    [
        ("000001fffeffffff", True),  # root's
        ("0000000000800000", True),  # CAP_SYS_NICE alone (bit 23)
        ("0000000000000000", False),
        ("00000000007fffff", False),  # every bit below it
    ],
)
def test_cap_sys_nice_is_read_from_the_effective_set(cap_eff, has):
    status = f"Name:\tpython\nCapInh:\t0000000000000000\nCapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\n"
    assert priority.has_capability(status, priority.CAP_SYS_NICE) is has
    assert priority.has_capability("Name:\tpython\n", priority.CAP_SYS_NICE) is False


def _node(ip: str, niceness: int, lowest: int) -> NodeFacts:
    return NodeFacts(
        f"node-{ip}", ip, "eth0", "lo", (), niceness=niceness, lowest_niceness=lowest, pid=7
    )


def test_a_niceness_every_rank_may_take_passes():
    priority.check(0, [_node("10.0.0.1", 15, -20), _node("10.0.0.2", 0, 0)])
    priority.check(15, [_node("10.0.0.1", 15, 15)])  # unchanged
    priority.check(19, [_node("10.0.0.1", 15, 15)])  # down is always allowed


def test_a_niceness_a_rank_may_not_take_names_the_parameter_the_rank_and_the_fix():
    nodes = [_node("10.0.0.1", 15, -20), _node("10.0.0.2", 15, 15), _node("10.0.0.3", 15, 15)]
    with pytest.raises(ConfigError) as info:
        priority.check(0, nodes)
    assert info.value.parameter == "niceness"
    message = str(info.value)
    assert message.startswith("niceness=0 is out of reach for 2 rank(s), the first on node")
    assert "(10.0.0.2, pid 7): it runs at 15 and may go no lower than 15" in message
    assert "CAP_SYS_NICE" in message and "RAY_worker_niceness=0 ray start" in message
    assert message.endswith("or leave niceness=None")


def test_without_a_niceness_niced_ranks_are_noted_once(caplog, monkeypatch):
    monkeypatch.setattr(priority, "_noted", False)
    with caplog.at_level(logging.INFO, logger="horovod_ray.rank.priority"):
        priority.check(None, [_node("10.0.0.1", 0, 0)])
        assert caplog.records == []  # normal priority: nothing to say
        for _ in range(2):
            priority.check(None, [_node("10.0.0.1", 15, 15), _node("10.0.0.2", 10, 10)])
    assert [r.getMessage() for r in caplog.records] == [
        f"the ranks run at niceness 10, 15 (Ray's worker_niceness), behind every other "
        f"process of their node; {priority.HINT}, or create_settings(niceness=0) where "
        f"the ranks may raise their priority"
    ]


def test_with_a_niceness_nothing_is_noted(caplog, monkeypatch):
    monkeypatch.setattr(priority, "_noted", False)
    with caplog.at_level(logging.INFO, logger="horovod_ray.rank.priority"):
        priority.check(15, [_node("10.0.0.1", 15, 15)])
    assert caplog.records == []


_APPLY = """
import json, os, threading
from horovod_ray.rank import priority

started, stop = threading.Event(), threading.Event()
def waiter():
    started.set()
    stop.wait()
old = threading.Thread(target=waiter)
old.start()
started.wait()
priority.apply(int(os.environ["NICENESS"]))
new = threading.Thread(target=stop.wait)  # started after: takes its creator's
new.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps([os.getpriority(os.PRIO_PROCESS, tid) for tid in tids]))
stop.set()
"""


def test_apply_sets_every_thread_and_the_threads_started_after():
    # Up from the test's own niceness is allowed without privilege.
    target = min(os.nice(0) + 3, 19)
    out = subprocess.run(
        [sys.executable, "-c", _APPLY],
        env={**os.environ, "NICENESS": str(target)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    nicenesses = json.loads(out.stdout)
    assert len(nicenesses) == 3  # main, the thread before, the thread after
    assert nicenesses == [target] * 3


class _Threads:
    """A process's thread list as it changes between reads, and the calls made on it."""

    def __init__(self, *reads: list[int], refuse: int | None = None, gone: int | None = None):
        self.reads, self.refuse, self.gone = list(reads), refuse, gone
        self.set: list[tuple[int, int]] = []

    def list(self) -> list[int]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    def setpriority(self, which: int, tid: int, niceness: int) -> None:
        assert which == os.PRIO_PROCESS
        if tid == self.refuse:
            raise PermissionError(13, "Permission denied")
        if tid == self.gone:
            raise ProcessLookupError(3, "No such process")
        self.set.append((tid, niceness))


def test_apply_lists_the_threads_again_until_none_is_new():
    # Thread 3 starts while 1 and 2 are set, thread 4 while 3 is.
    threads = _Threads([1, 2], [1, 2, 3], [1, 3, 4], gone=2)
    priority.apply(5, setpriority=threads.setpriority, list_threads=threads.list)
    assert threads.set == [(1, 5), (3, 5), (4, 5)]  # 2 ended meanwhile: passed over


def test_apply_refused_by_the_kernel_names_the_parameter_and_the_fix():
    threads = _Threads([1, 2], refuse=2)
    with pytest.raises(ConfigError) as info:
        priority.apply(0, setpriority=threads.setpriority, list_threads=threads.list)
    assert info.value.parameter == "niceness"
    assert str(info.value).startswith("niceness=0 was refused on this rank (Permission denied)")
    assert priority.HINT in str(info.value)
