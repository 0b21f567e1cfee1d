"""Elastic jobs' pure parts: slots per node, membership changes, argument checks (no Ray)."""

from __future__ import annotations

import importlib
import logging
import pickle

import pytest
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.elastic.discovery import FixedHosts

import horovod_ray
from horovod_ray import RayExecutor
from horovod_ray.errors import ConfigError, ExecutorStateError
from horovod_ray.job import demand, draining
from horovod_ray.job.discovery import narrow, node_slots, staying
from horovod_ray.job.elastic_driver import rank_info
from horovod_ray.job.layouts import ElasticLayout
from horovod_ray.rank.assignment import RankInfo, membership_change

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def _node(node_id: str, cpus: float, gpus: float = 0, alive: bool = True, ip: str = "10.0.0.1"):
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": ip, "Resources": resources}


def test_node_slots_counts_whole_ranks_on_alive_nodes():
    nodes = [
        _node("head", 0),
        _node("a", 2),
        _node("b", 3.5),
        _node("dead", 8, alive=False),
        _node("c", 4, ip="10.0.0.2"),
    ]
    assert node_slots(nodes, {"CPU": 1.0}) == {"a": 2, "b": 3, "c": 4}
    assert node_slots(nodes, {"CPU": 2.0}) == {"a": 1, "b": 1, "c": 2}
    assert node_slots(nodes, {"CPU": 1.0}, only_ip="10.0.0.2") == {"c": 4}


def test_node_slots_is_bounded_by_the_scarcest_resource():
    nodes = [_node("g", 8, gpus=2), _node("cpu-only", 8)]
    assert node_slots(nodes, {"CPU": 1.0, "GPU": 1.0}) == {"g": 2}


def _world(hosts: list[tuple[str, int]]) -> list[RankInfo]:
    """A world as horovod's driver numbers it, taken in at the edge as rank records."""
    size = sum(n for _, n in hosts)
    slots, rank = [], 0
    for host, count in hosts:
        for local in range(count):
            slots.append(rank_info(SlotInfo(host, rank, local, 0, size, count, 1)))
            rank += 1
    return slots


def test_draining_nodes_are_left_out_of_the_slots():
    nodes = [_node("a", 2), _node("b", 2), _node("c", 2)]
    left = staying(nodes, {"b": 30.0})
    assert [n["NodeID"] for n in left] == ["a", "c"]
    assert node_slots(left, {"CPU": 1.0}) == {"a": 2, "c": 2}
    assert staying(nodes, {}) == nodes


def test_draining_deadlines_become_seconds_left():
    now = 1_000.0
    deadlines = {"soon": 1_030_000, "none": 0, "past": 990_000}
    assert draining.seconds_left(deadlines, now) == {
        "soon": 30.0,
        "none": float("inf"),
        "past": 0.0,
    }
    assert draining.describe(30.4) == "deadline in 30 s"
    assert draining.describe(float("inf")) == "no deadline"


def test_a_static_jobs_draining_error_names_the_ranks_on_draining_nodes():
    ranks = {0: ("on node aaa", "a"), 1: ("on node bbb", "b"), 2: ("on node bbb", "b")}
    error = draining.static_job_error(ranks, {"b": 42.0, "z": 1.0})
    assert error.failures == {
        1: "on node bbb, which Ray is draining (deadline in 42 s)",
        2: "on node bbb, which Ray is draining (deadline in 42 s)",
    }
    text = str(error)
    assert text.startswith("Ray is draining a node of the job")
    assert "max_restarts" in text and "--- rank 2: on node bbb" in text
    assert isinstance(error, horovod_ray.WorkerFailedError)  # so run(max_restarts) retries
    assert pickle.loads(pickle.dumps(error)).failures == error.failures


@pytest.mark.parametrize(
    ("leaving", "wait_s"),
    [
        ({"b": 42.0}, 42.0 - draining.UPLOAD_MARGIN_S),  # up to the deadline, less a margin
        ({"b": 42.0, "c": 20.0}, 20.0 - draining.UPLOAD_MARGIN_S),  # the nearest one
        ({"b": 3.0}, 0.0),  # no time left for it
        ({"b": float("inf")}, draining.UPLOAD_WAIT_MAX_S),  # no deadline: bounded anyway
        ({"b": 900.0}, draining.UPLOAD_WAIT_MAX_S),
        ({"a": 42.0, "b": 42.0}, 0.0),  # rank 0's own node drains
        ({}, 0.0),
    ],
)
def test_rank_0_on_a_node_that_stays_may_finish_its_uploads_within_the_deadline(leaving, wait_s):
    assert draining.upload_wait_s(leaving, "a") == wait_s


CPU = {"CPU": 1.0}
GPU = {"GPU": 1.0}


def _sent(record: dict) -> dict:
    """The record once Ray took its pending request (the send's second phase)."""
    return {**record, "pending": None, "confirmed": record["pending"]}


def test_the_autoscaler_request_is_every_live_jobs_demand_and_other_drivers():
    jobs = {"a": {"bundles": [CPU] * 2, "until": 100}, "b": {"bundles": [GPU], "until": 100}}
    # No record yet: what stands is another driver's.
    request, expired, record = demand.combine([{"CPU": 4}], None, jobs, now_s=50)
    assert request == [{"CPU": 4}, CPU, CPU, GPU] and expired == []
    assert record == {"pending": request, "confirmed": [{"CPU": 4}], "others": [{"CPU": 4}]}
    record = _sent(record)
    # What stands is what was sent (grouped, ints for floats): the others stay as kept.
    standing = [GPU, {"CPU": 1}, {"CPU": 4.0}, CPU]
    request, _, _ = demand.combine(standing, record, {"b": jobs["b"]}, now_s=50)
    assert request == [{"CPU": 4}, GPU]
    # Another driver asked since: its request replaces the kept one.
    request, _, again = demand.combine([{"TPU": 8}], record, jobs, now_s=50)
    assert request == [{"TPU": 8}, CPU, CPU, GPU] and again["others"] == [{"TPU": 8}]


def test_another_driver_clearing_its_request_is_not_undone():
    """Found by a review: with the request before the last taken as ours too, [] read as
    ours after the other driver cleared, and its old request came back for good."""
    job = {"a": {"bundles": [CPU], "until": 100}}
    _, _, first = demand.combine([], None, {}, now_s=50)  # no job yet: [] sent
    request, _, record = demand.combine([{"TPU": 8}], _sent(first), job, now_s=50)
    assert request == [{"TPU": 8}, CPU]
    request, _, _ = demand.combine([], _sent(record), job, now_s=50)  # it cleared its own
    assert request == [CPU]


def test_a_send_that_died_half_way_changes_nothing_later_sends_rely_on():
    jobs = {"a": {"bundles": [CPU], "until": 100}}
    first, _, record = demand.combine([{"CPU": 4}], None, jobs, now_s=50)
    record = _sent(record)
    jobs["b"] = {"bundles": [GPU], "until": 100}
    second, _, pending = demand.combine(first, record, jobs, now_s=50)
    # Died before Ray took it: what stands is still the confirmed request.
    assert demand.combine(first, pending, jobs, now_s=50)[0] == second
    # Died after Ray took it, before confirming: what stands is the pending one.
    assert demand.combine(second, pending, jobs, now_s=50)[0] == second
    # Two sends that both failed in Ray: the confirmed request still stands, still ours.
    jobs["c"] = {"bundles": [CPU], "until": 100}
    _, _, again = demand.combine(first, pending, jobs, now_s=50)
    assert demand.combine(first, again, jobs, now_s=50)[0] == [{"CPU": 4}, CPU, GPU, CPU]


def test_malformed_records_are_neither_others_nor_live_jobs():
    jobs = {"bad": {"bundles": "CPU", "until": 100}, "worse": None, "odd": {"until": "x"}}
    request, expired, _ = demand.combine([{"CPU": 4}], ["not", "a", "record"], jobs, 50)
    assert request == [{"CPU": 4}] and expired == ["bad", "odd", "worse"]


def test_a_job_whose_lease_ran_out_is_dropped_from_the_request():
    jobs = {"alive": {"bundles": [CPU], "until": 100}, "dead": {"bundles": [GPU], "until": 40}}
    request, expired, _ = demand.combine([], None, jobs, now_s=50)
    assert request == [CPU] and expired == ["dead"]
    assert demand.combine([], None, {}, now_s=50)[0] == []


def test_a_restart_budget_spent_on_drains_still_says_drain():
    from horovod_ray.failures.restarts import spent

    ranks = {0: ("on node aaa", "a")}
    drained = draining.static_job_error(ranks, {"a": 5.0})
    error = spent([horovod_ray.WorkerFailedError({0: "died"}), drained])
    assert isinstance(error, horovod_ray.NodeDrainingError) and error.failures == drained.failures
    assert "--- attempt 0: " in str(error) and "--- attempt 1: Ray is draining" in str(error)


def test_membership_change_names_nodes_and_ranks():
    six = _world([("a", 2), ("b", 2), ("c", 2)])
    four = _world([("a", 2), ("b", 2)])
    assert membership_change([], six, 0) == {
        "event": "membership",
        "reset": 0,
        "size_before": 0,
        "size_after": 6,
        "nodes_added": ["a", "b", "c"],
        "nodes_removed": [],
        "ranks_added": [0, 1, 2, 3, 4, 5],
        "ranks_removed": [],
    }
    shrink = membership_change(six, four, 1)
    assert (shrink["size_before"], shrink["size_after"]) == (6, 4)
    assert shrink["nodes_removed"] == ["c"] and shrink["ranks_removed"] == [4, 5]
    grow = membership_change(four, _world([("a", 2), ("b", 2), ("d", 2)]), 2)
    assert grow["nodes_added"] == ["d"] and grow["ranks_added"] == [4, 5]
    # Losing the middle node: its ranks (2, 3) go, and c's slots become ranks 2 and 3.
    middle = membership_change(six, _world([("a", 2), ("c", 2)]), 3)
    assert middle["nodes_removed"] == ["b"] and middle["ranks_removed"] == [2, 3]
    assert middle["ranks_added"] == []


def test_run_refuses_sizes_on_an_elastic_job():
    import horovod_ray

    for name in ("num_hosts", "num_slots"):
        with pytest.raises(ConfigError) as raised:
            horovod_ray.run(print, min_workers=2, **{name: 2})
        assert raised.value.parameter == name


def test_an_elastic_job_refuses_stacks_naming_the_reason():
    with pytest.raises(ExecutorStateError, match="stacks is not available on an elastic job"):
        RayExecutor(min_workers=2).stacks()


@pytest.fixture
def no_ray(monkeypatch):
    """Makes run() fail at once where it would start or join Ray: these tests stay pure."""
    run_module = importlib.import_module("horovod_ray.run")

    def refuse(*args, **kwargs):
        raise AssertionError("run() reached Ray: the arguments were not refused first")

    monkeypatch.setattr(run_module.local_ray, "start", refuse)
    monkeypatch.setattr(run_module.ray, "init", refuse)


@pytest.mark.parametrize("name, value", [("cooldown_range", (1, 2)), ("discovery_interval_s", 0.5)])
def test_run_refuses_elastic_limits_on_a_static_job(no_ray, name, value):
    import horovod_ray

    # Good values, refused only because the job has no min_workers: run() must pass them
    # on to RayExecutor, which refuses them before Ray starts.
    with pytest.raises(ConfigError) as raised:
        horovod_ray.run(print, num_slots=2, **{name: value})
    assert raised.value.parameter == name
    assert "give min_workers too" in str(raised.value)


@pytest.mark.parametrize(
    "name, value, text",
    [("cooldown_range", (0, 5), "1 <= low"), ("discovery_interval_s", 0, "> 0")],
)
def test_run_passes_elastic_limits_to_an_elastic_job(no_ray, name, value, text):
    import horovod_ray

    # A bad value is refused by the elastic layout, which only sees what run() passed on.
    with pytest.raises(ConfigError) as raised:
        horovod_ray.run(print, min_workers=2, **{name: value})
    assert raised.value.parameter == name
    assert text in str(raised.value)


@pytest.mark.parametrize(
    "kwargs, parameter, text",
    [
        ({"min_workers": 0}, "min_workers", "> 0"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers", "below min_workers=3"),
        ({"min_workers": 2, "max_workers": 0}, "max_workers", "> 0"),
        ({"min_workers": 1, "reset_limit": -1}, "reset_limit", ">= 0"),
        ({"min_workers": 1, "cooldown_range": (0, 5)}, "cooldown_range", "1 <= low"),
        ({"min_workers": 1, "cooldown_range": 5}, "cooldown_range", "(low, high)"),
        ({"min_workers": 1, "elastic_timeout": 0}, "elastic_timeout", "> 0"),
        ({"min_workers": 1, "cpus_per_worker": 0}, "cpus_per_worker", "> 0"),
        ({"min_workers": 2, "num_workers": 2}, "min_workers", "leave num_workers"),
        ({"min_workers": 2, "num_hosts": 1}, "min_workers", "leave num_workers"),
        ({"max_workers": 4}, "min_workers", "max_workers needs min_workers"),
        ({"num_workers": 2, "reset_limit": 3}, "reset_limit", "give min_workers too"),
        ({"num_workers": 2, "elastic_timeout": -9}, "elastic_timeout", "> 0"),
        ({"min_workers": 1, "override_discovery": False}, "override_discovery", "MyDiscovery()"),
        ({"min_workers": 1, "override_discovery": {"a": 1}}, "override_discovery", "got dict"),
        (
            {"num_workers": 2, "override_discovery": FixedHosts({"a": 1})},
            "override_discovery",
            "give min_workers too",
        ),
    ],
)
def test_bad_elastic_arguments_are_refused_at_construction(kwargs, parameter, text):
    with pytest.raises(ConfigError) as raised:
        RayExecutor(**kwargs)
    assert raised.value.parameter == parameter
    assert text in str(raised.value)


def test_elastic_layout_keeps_the_bounds():
    layout = ElasticLayout(min_workers=2, max_workers=6, cooldown_range=[5, 60])
    assert layout.cooldown_range == (5, 60)
    executor = RayExecutor(min_workers=2, max_workers=6)
    assert executor.layout.worker_resources() == {"CPU": 1.0}  # what each rank reserves
    assert executor.elastic.max_workers == 6


def test_a_users_discovery_travels_to_the_elastic_layout():
    hosts = FixedHosts({"10.0.0.2": 2})
    assert RayExecutor(min_workers=1, override_discovery=hosts).elastic.discovery is hosts
    assert RayExecutor(min_workers=1).elastic.discovery is None  # Ray's nodes


NAMED = [
    {**_node("head", 4, ip="10.0.0.1"), "NodeManagerHostname": "head-host"},
    {**_node("n2", 4, ip="10.0.0.2"), "NodeManagerHostname": "worker-2"},
    {**_node("n3", 4, ip="10.0.0.3"), "NodeManagerHostname": "worker-3"},
    {**_node("twin-a", 2, ip="10.0.0.9"), "NodeManagerHostname": "twins"},
    {**_node("twin-b", 2, ip="10.0.0.9"), "NodeManagerHostname": "twins"},
]


@pytest.mark.parametrize(
    "wanted, narrowed, unknown",
    [
        ({"10.0.0.2": 2}, {"n2": 2}, []),  # only what is named, its slots
        ({"worker-2": 8, "n3": None}, {"n2": 4, "n3": 4}, []),  # at most the room; None: room
        ({"localhost": 1}, {"head": 1}, []),  # the driver's node
        ({"10.0.0.7": 2, "twins": 1}, {}, ["10.0.0.7", "twins"]),  # none, or several
        ({"twin-b": 5, "n2": 0}, {"twin-b": 2}, []),  # a node id; no slots: left out
    ],
)
def test_a_users_discovery_narrows_rays_nodes(wanted, narrowed, unknown):
    slots = node_slots(NAMED, {"CPU": 1})
    assert narrow(slots, wanted, NAMED, driver_node_id="head") == (narrowed, unknown)


def test_a_static_job_takes_horovod_rays_elastic_timeout_and_says_it_is_ignored(caplog):
    """horovod.ray's RayExecutor has elastic_timeout=600 by default and ignores it on a
    static job: code that passes it must run here too (it was a ConfigError)."""
    with caplog.at_level(logging.WARNING, logger="horovod_ray.job.layouts"):
        executor = RayExecutor(num_workers=2, elastic_timeout=600)
    assert executor.elastic is None
    assert [r.getMessage() for r in caplog.records] == [
        "elastic_timeout=600 is ignored: this is a static job (it is for elastic jobs, "
        "with min_workers)"
    ]


def test_the_driver_tells_rank_0_again_until_a_world_follows_the_hosts(monkeypatch):
    """horovod tells rank 0 once per change of hosts, and rank 0 drops what it hears while
    it resets; the driver tells it again while the hosts would give another world than the
    current one, and stops once a world is planned on them (horovod's driver, with fake
    ranks and a fake notification client: rank 0's side is test_elastic's)."""
    import threading
    import time

    from horovod.runner.elastic import driver as horovod_driver
    from horovod.runner.elastic.worker import HostUpdateResult

    from horovod_ray.job import elastic_driver

    told: list[HostUpdateResult] = []

    class Client:  # rank 0's notification service, as horovod's driver reaches it
        def __init__(self, *args, **kwargs) -> None:
            pass

        def notify_hosts_updated(self, timestamp: int, update: HostUpdateResult) -> None:
            told.append(update)

    class Rendezvous:
        def init(self, plan: list) -> None:
            pass

        def stop(self) -> None:
            pass

    def rank(slot: SlotInfo, events: list[threading.Event]) -> tuple[int, float]:
        events[0].wait()  # the driver's shutdown
        return 0, time.time()

    def wait_for(condition) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.02)

    monkeypatch.setattr(elastic_driver, "RETELL_S", 0.05)
    monkeypatch.setattr(horovod_driver, "WorkerNotificationClient", Client)
    hosts = FixedHosts({"a": 2})
    driver = elastic_driver.Driver(Rendezvous(), hosts, min_num_proc=2, max_num_proc=4)
    try:
        driver.start(2, rank)
        driver.register_worker_server("a", 0, {}, b"key")  # rank 0 listens
        time.sleep(0.3)
        assert told == []  # the world is what the hosts give
        hosts.set({"a": 2, "b": 2})
        wait_for(lambda: len(told) >= 4)  # horovod's one telling, and the driver's again
        assert told[0] == HostUpdateResult.added
        assert set(told[1:]) == {HostUpdateResult.mixed}, told
        driver.resume()  # rank 0 reset: the world is planned on both hosts
        assert driver.world_size() == 4
        settled = len(told)
        time.sleep(0.3)
        assert len(told) <= settled + 1, told  # one may have been under way
    finally:
        driver.stop()
    assert not driver._retell_thread.is_alive()
