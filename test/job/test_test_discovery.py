"""horovod.ray's TestDiscovery: its schedule of host sets over time, its bounds, its seed,
its arguments (no Ray: a fake clock and a fake underlying discovery)."""

from __future__ import annotations

import inspect
import itertools
import logging
import random

import horovod.ray.elastic
import pytest
from horovod.runner.elastic.discovery import HostDiscovery

import horovod_ray.elastic
from horovod_ray import ConfigError
from horovod_ray.discovery import chaos
from horovod_ray.discovery.chaos import HostChange, TestDiscovery, next_change
from horovod_ray.elastic import RayHostDiscovery

pytestmark = pytest.mark.unit


ORIGIN = 1000.0  # the fake clock's reading at the first call: not 0, as monotonic's isn't


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = ORIGIN

    def __call__(self) -> float:
        return self.now


class Hosts(HostDiscovery):
    """The underlying discovery: hosts the test sets, and how often it was asked."""

    def __init__(self, hosts: dict[str, int]) -> None:
        super().__init__()
        self.hosts = dict(hosts)
        self.calls = 0

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        self.calls += 1
        return dict(self.hosts)


def _chaos(hosts: dict[str, int], min_hosts=2, max_hosts=3, every_s=10.0, **kwargs):
    clock, underlying = Clock(), Hosts(hosts)
    kwargs.setdefault("seed", 0)
    discovery = TestDiscovery(
        min_hosts, max_hosts, every_s, discovery=underlying, clock=clock, **kwargs
    )
    return discovery, clock, underlying


def _offered_at(discovery: TestDiscovery, clock: Clock, times: list[float]) -> list[list[str]]:
    """What the discovery offers at each of ``times`` (seconds after ORIGIN)."""
    offered = []
    for t in times:
        clock.now = ORIGIN + t
        offered.append(sorted(discovery.find_available_hosts_and_slots()))
    return offered


class _Rng:
    """A stand-in for random.Random: a fixed coin, the first of each pool (recorded)."""

    def __init__(self, coin: float) -> None:
        self.coin = coin
        self.pools: list[list[str]] = []

    def random(self) -> float:
        return self.coin

    def choice(self, pool):
        self.pools.append(list(pool))
        return pool[0]


@pytest.mark.parametrize(
    ("offered", "hidden", "coin", "expected"),
    [
        # At min_hosts (2) or fewer: show a hidden host, whatever the coin.
        ("ab", "c", 0.0, ("c", False)),
        ("a", "cb", 0.0, ("b", False)),  # drawn from a sorted pool
        ("ab", "", 0.0, None),  # nothing to show, and never hide at the minimum
        ("", "", 0.0, None),
        # At max_hosts (4) or more: hide one, whatever the coin.
        ("dcba", "", 0.9, ("a", True)),
        ("edcba", "f", 0.9, ("a", True)),
        # In between: the coin (below 0.5: hide).
        ("cab", "d", 0.4, ("a", True)),
        ("cab", "d", 0.6, ("d", False)),
        ("cab", "", 0.6, None),  # the coin says show, and none is hidden
    ],
)
def test_next_change_hides_above_the_minimum_and_shows_below_the_maximum(
    offered, hidden, coin, expected
):
    rng = _Rng(coin)
    assert next_change(list(offered), list(hidden), 2, 4, rng) == expected
    assert all(pool == sorted(pool) for pool in rng.pools)


def test_the_schedule_changes_one_host_every_change_frequency_s():
    """min_hosts=2, max_hosts=3 over three hosts: the timer starts at the first call; then
    hide (3 is the maximum), show (2 is the minimum), hide, ..., one change per due call."""
    discovery, clock, _ = _chaos({"a": 1, "b": 2, "c": 1})
    offered = _offered_at(discovery, clock, [0, 5, 9.9, 10, 15, 19.9, 20, 29, 30])
    assert [len(hosts) for hosts in offered] == [3, 3, 3, 2, 2, 2, 3, 3, 2]
    changes = discovery.changes
    assert [(c.at_s - ORIGIN, c.hidden, c.num_offered) for c in changes] == [
        (10, True, 2),
        (20, False, 3),
        (30, True, 2),
    ]
    assert changes[1].host == changes[0].host  # the one hidden is the one shown again
    assert changes[0].host not in offered[3] and discovery.hidden == {changes[2].host}
    assert all(c.num_killed == 0 for c in changes)  # graceful: nothing killed
    # The slots are the underlying discovery's.
    clock.now += 1
    assert discovery.find_available_hosts_and_slots() == {
        host: slots for host, slots in {"a": 1, "b": 2, "c": 1}.items() if host in offered[-1]
    }


def test_a_late_call_makes_one_change_and_restarts_the_timer():
    discovery, clock, _ = _chaos({"a": 1, "b": 1, "c": 1, "d": 1}, max_hosts=3)
    assert [len(h) for h in _offered_at(discovery, clock, [0, 100])] == [4, 3]  # not 2
    assert len(discovery.changes) == 1
    assert [len(h) for h in _offered_at(discovery, clock, [105, 109.9])] == [3, 3]
    assert len(discovery.changes) == 1


def test_the_offered_hosts_stay_within_the_bounds_one_change_at_a_time():
    hosts = {f"10.0.0.{i}": 2 for i in range(8)}
    discovery, clock, _ = _chaos(hosts, min_hosts=3, max_hosts=6, every_s=1, seed=11)
    counts = [len(h) for h in _offered_at(discovery, clock, list(range(300)))]
    # From 8, one host hidden per change until the maximum; then within the bounds.
    assert counts[:4] == [8, 7, 6, 5]
    settled = counts[3:]
    assert min(settled) == 3 and max(settled) == 6  # both bounds reached, neither passed
    assert all(abs(b - a) <= 1 for a, b in itertools.pairwise(counts))
    assert any(not c.hidden for c in discovery.changes)  # hosts come back too


def test_one_seed_replays_one_schedule_whatever_the_order_of_the_hosts():
    hosts = {name: 1 for name in "abcdefgh"}

    def schedule(seed: int, order: str) -> list[tuple[str, bool]]:
        discovery, clock, _ = _chaos(
            {h: hosts[h] for h in order}, min_hosts=2, max_hosts=7, every_s=1, seed=seed
        )
        _offered_at(discovery, clock, list(range(60)))
        return [(c.host, c.hidden) for c in discovery.changes]

    first = schedule(5, "abcdefgh")
    assert len(first) == 59
    assert schedule(5, "abcdefgh") == first
    assert schedule(5, "hgfedcba") == first  # the pools are sorted, not in dict order
    assert schedule(6, "abcdefgh") != first


def test_a_hidden_host_that_leaves_is_forgotten_and_offered_when_it_returns():
    discovery, clock, underlying = _chaos({"a": 1, "b": 1, "c": 1})
    _offered_at(discovery, clock, [0, 10])
    (gone,) = discovery.hidden
    del underlying.hosts[gone]
    assert len(_offered_at(discovery, clock, [11])[0]) == 2 and discovery.hidden == set()
    underlying.hosts[gone] = 1
    assert gone in _offered_at(discovery, clock, [12])[0]


def test_fewer_hosts_than_min_hosts_are_all_offered():
    discovery, clock, _ = _chaos({"a": 1}, min_hosts=2, max_hosts=3)
    assert _offered_at(discovery, clock, [0, 10, 20, 30]) == [["a"]] * 4
    assert discovery.changes == ()


def test_forceful_kills_the_ranks_of_each_host_it_hides_and_graceful_none(monkeypatch):
    killed: list[str] = []

    def kill(host: str, ranks) -> int:
        assert ranks() == {"actor-1"}  # the job's own ranks, bound as it started
        killed.append(host)
        return 2

    monkeypatch.setattr(chaos, "_kill_ranks_on", kill)
    forceful, clock, _ = _chaos({"a": 1, "b": 1, "c": 1}, _graceful=False)
    forceful.bind_ranks(lambda: {"actor-1"})
    _offered_at(forceful, clock, [0, 10, 20, 30])
    hid = [c for c in forceful.changes if c.hidden]
    assert killed == [c.host for c in hid] and len(killed) == 2
    assert [c.num_killed for c in forceful.changes] == [2, 0, 2]  # showing kills nothing
    graceful, clock, _ = _chaos({"a": 1, "b": 1, "c": 1})
    _offered_at(graceful, clock, [0, 10, 20, 30])
    assert len(graceful.changes) == 3 and len(killed) == 2


def test_a_failed_kill_is_logged_and_the_host_stays_hidden(monkeypatch, caplog):
    def no_ray():
        raise RuntimeError("Ray is not initialised")

    monkeypatch.setattr(chaos.ray, "get_runtime_context", no_ray)
    discovery, clock, _ = _chaos({"a": 1, "b": 1, "c": 1}, _graceful=False)
    discovery.bind_ranks(set)
    with caplog.at_level(logging.WARNING, logger=chaos.__name__):
        offered = _offered_at(discovery, clock, [0, 10])
    (change,) = discovery.changes
    assert change.hidden and change.num_killed == 0 and change.host not in offered[1]
    assert f"the ranks on host {change.host} could not be killed" in caplog.text


def test_each_change_is_logged_at_info_when_verbose(caplog):
    for verbose, level in ((True, logging.INFO), (False, logging.DEBUG)):
        caplog.clear()
        discovery, clock, _ = _chaos({"a": 1, "b": 1, "c": 1}, verbose=verbose)
        with caplog.at_level(logging.DEBUG, logger=chaos.__name__):
            _offered_at(discovery, clock, [0, 10])
        (record,) = [r for r in caplog.records if "TestDiscovery: hid host" in r.message]
        assert record.levelno == level and "2 of 3 hosts offered" in record.message


def test_by_default_the_hosts_are_ray_nodes_as_ray_host_discovery_counts_them(monkeypatch):
    nodes = [
        {"NodeID": n, "NodeManagerAddress": f"10.0.0.{i}", "Alive": True,
         "Resources": {"CPU": 4, "GPU": 1}}
        for i, n in enumerate("abc")
    ]  # fmt: skip
    monkeypatch.setattr(chaos.ray, "nodes", lambda: nodes)
    discovery = TestDiscovery(2, 3, 10, use_gpu=True, cpus_per_slot=2, seed=0)
    assert discovery.find_available_hosts_and_slots() == {
        "10.0.0.0": 1, "10.0.0.1": 1, "10.0.0.2": 1
    }  # fmt: skip
    assert TestDiscovery(2, 3, 10, cpus_per_slot=2).find_available_hosts_and_slots() == {
        "10.0.0.0": 2, "10.0.0.1": 2, "10.0.0.2": 2
    }  # fmt: skip


def test_horovod_rays_constructor_and_the_drop_in_names():
    """horovod.ray.elastic.TestDiscovery's arguments, in its order and with its defaults,
    then the keyword-only ones of this package; exported where horovod.ray had it."""
    theirs = inspect.signature(horovod.ray.elastic.TestDiscovery).parameters
    ours = inspect.signature(TestDiscovery).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in theirs)
    rest = [ours[n].kind for n in list(ours)[len(theirs) :]]
    assert rest and set(rest) == {inspect.Parameter.KEYWORD_ONLY}
    assert horovod_ray.elastic.TestDiscovery is TestDiscovery
    assert horovod_ray.elastic.HostChange is HostChange
    # As horovod's example builds it.
    discovery = TestDiscovery(
        min_hosts=2, max_hosts=5, change_frequency_s=20, use_gpu=True, cpus_per_slot=1,
        _graceful=False, verbose=False,
    )  # fmt: skip
    assert isinstance(discovery, HostDiscovery) and discovery.hidden == frozenset()


@pytest.mark.parametrize(
    ("kwargs", "parameter", "says"),
    [
        ({"min_hosts": 0}, "min_hosts", "min_hosts must be > 0, got 0"),
        ({"min_hosts": 1.5}, "min_hosts", "min_hosts must be an integer > 0"),
        ({"min_hosts": True}, "min_hosts", "min_hosts must be an integer > 0"),
        ({"max_hosts": 1}, "max_hosts", "max_hosts=1 is below min_hosts=2: give max_hosts >="),
        ({"max_hosts": 0}, "max_hosts", "max_hosts must be > 0"),
        ({"change_frequency_s": 0}, "change_frequency_s", "seconds > 0, got 0"),
        ({"change_frequency_s": -1}, "change_frequency_s", "seconds > 0, got -1"),
        ({"change_frequency_s": float("nan")}, "change_frequency_s", "a finite number"),
        ({"change_frequency_s": "10"}, "change_frequency_s", "a finite number"),
        ({"cpus_per_slot": 0}, "cpus_per_slot", "cpus_per_slot must be > 0"),
        ({"gpus_per_slot": -1}, "gpus_per_slot", "gpus_per_slot must be > 0"),
        ({"use_gpu": 1}, "use_gpu", "use_gpu must be True or False, got 1"),
        ({"_graceful": "no"}, "_graceful", "_graceful must be True or False"),
        ({"verbose": None}, "verbose", "verbose must be True or False"),
        ({"seed": 1.5}, "seed", "seed must be an int"),
        ({"clock": 5}, "clock", "clock must be a function"),
        ({"discovery": {"a": 1}}, "discovery", "must be a horovod HostDiscovery"),
        ({"discovery": "hosts", "cpus_per_slot": 2}, "discovery", "must be a horovod"),
        ({"cpus_per_slot": 2, "discovery": True}, "discovery", "must be a horovod"),
    ],
)
def test_a_bad_argument_is_named_before_any_host_is_asked_for(kwargs, parameter, says):
    underlying = Hosts({"a": 1})
    arguments = {"min_hosts": 2, "max_hosts": 3, "change_frequency_s": 10}
    arguments.update(kwargs)
    arguments.setdefault("discovery", underlying)
    with pytest.raises(ConfigError, match=says) as raised:
        TestDiscovery(**arguments)
    assert raised.value.parameter == parameter
    assert underlying.calls == 0


def test_the_default_discoverys_arguments_clash_with_ones_own_discovery():
    with pytest.raises(ConfigError, match="leave them out and count the slots there") as raised:
        TestDiscovery(2, 3, 10, use_gpu=True, discovery=Hosts({"a": 1}))
    assert raised.value.parameter == "discovery"
    assert isinstance(TestDiscovery(2, 3, 10)._hosts, RayHostDiscovery)


def test_a_seedless_schedule_draws_from_its_own_generator(monkeypatch):
    """seed=None: not the process's shared ``random`` (horovod.ray's), which user code and
    libraries also draw from."""
    monkeypatch.setattr(random, "random", lambda: pytest.fail("drew from the shared random"))
    monkeypatch.setattr(random, "choice", lambda _: pytest.fail("drew from the shared random"))
    discovery, clock, _ = _chaos({h: 1 for h in "abcde"}, max_hosts=5, seed=None)
    _offered_at(discovery, clock, [0, 10, 20, 30])
    assert len(discovery.changes) == 3


def test_forceful_outside_a_job_kills_nothing(caplog):
    """Bound by no job, it cannot tell its ranks from another job's (a concurrent Tune
    trial's): it hides the host and kills nothing."""
    discovery, clock, _ = _chaos({"a": 1, "b": 1, "c": 1}, _graceful=False)
    with caplog.at_level(logging.WARNING, logger=chaos.__name__):
        _offered_at(discovery, clock, [0, 10])
    (change,) = discovery.changes
    assert change.hidden and change.num_killed == 0
    assert "no job runs with it" in caplog.text
