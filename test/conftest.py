"""Shared fixtures: real local Ray instances and clusters, and leak checks."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

import pytest

# Inherited by the Ray workers these tests start: keeps TensorFlow's start-up chatter out.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray declares a killed node dead after it misses 5 health checks, one every 3 s by default
# (about 17 s here); two a second in the Rays these tests start (about 7 s), so that the
# tests that kill nodes wait less on Ray's detection, which is not what they test.
os.environ.setdefault("RAY_health_check_period_ms", "500")
# Ray Train's API as the caller has it: bench.harness.common, which test modules import, turns
# Ray Train v2 off for the benchmarks' HorovodTrainer (see pytest_collection_finish).
_TRAIN_V2 = os.environ.get("RAY_TRAIN_V2_ENABLED")

import ray  # noqa: E402
from ray.util import state as ray_state  # noqa: E402

from horovod_ray import local_ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent  # the checkout

# What kind of Ray this process holds now, so that modules can share one.
_current: dict[str, object] = {"kind": None}


def _shutdown() -> None:
    # Each Ray's monitor first, or its stop waits a second on it (see local_ray).
    if ray.is_initialized():
        local_ray.stop()
    cluster = _current.get("cluster")
    if cluster is not None:
        if cluster.head_node is not None:
            local_ray.stop_monitor(cluster.head_node)
        cluster.shutdown()
    _current.clear()
    _current["kind"] = None


def start_local_ray(
    num_cpus: int = 4, num_gpus: int = 0, log_to_driver: bool = False, metrics: bool = False
) -> None:
    """A local Ray with the given resources, reused when one like it is already up; the
    workers' output reaches this process only if ``log_to_driver``. With ``metrics``, its
    dashboard runs (it writes the metrics ports' service-discovery file) and every process
    exports its metrics each second (Ray's default: every 10 s)."""
    kind = ("local", num_cpus, num_gpus, log_to_driver, metrics)
    if _current["kind"] == kind and ray.is_initialized():
        return
    _shutdown()
    # "local": a new instance, never another Ray that happens to run on this machine.
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        log_to_driver=log_to_driver,
        **(
            {"include_dashboard": True, "_system_config": {"metrics_report_interval_ms": 1000}}
            if metrics
            else {}
        ),
    )
    _current["kind"] = kind


@pytest.fixture(autouse=True)
def _unit_tests_take_no_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``unit`` runs in the first, Ray-less pass of ``make test``: one that
    starts Ray there fails, rather than slowing that pass down and leaking into the next.
    (A Ray an earlier module left running, as in the 2023 line's mixed pass, is not its.)"""
    before = ray.is_initialized()
    yield
    unit = request.node.get_closest_marker("unit") is not None
    if unit and not before and ray.is_initialized():
        _shutdown()
        pytest.fail("a unit test started Ray: drop its pytestmark, or its use of Ray")


@pytest.fixture
def ray_4cpu() -> Iterator[None]:
    """A local single-node Ray with 4 CPUs: the one already up when it is that, so a test
    that needs another kind of Ray starts it and leaves it for whoever asks next."""
    start_local_ray(4)
    yield


def start_cluster(cpus_per_node: list[int]) -> ray.cluster_utils.Cluster:
    """Several Ray nodes (raylets, each with its own node id) on this machine."""
    from ray.cluster_utils import Cluster

    _shutdown()
    cluster = Cluster()
    for cpus in cpus_per_node:
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    _current.update(kind=("cluster", tuple(cpus_per_node)), cluster=cluster)
    return cluster


def shut_down_own_ray() -> None:
    """Shuts down whatever Ray this process holds (a later fixture starts its own)."""
    _shutdown()


def horovod_gloo() -> tuple[Path, list[str]]:
    """The Gloo library that ``make install`` compiled into horovod's TensorFlow extension
    (its C++17 copy of third_party/gloo, patches applied), and the defines and include
    folders CMake compiled it with: what a native test (test/native/) builds against."""
    from bench.cases.scale import horovod_tree

    _, build = horovod_tree()  # this environment's TensorFlow line's
    libraries = sorted(build.glob("third_party/compatible17_gloo/gloo/*.a"))
    assert libraries, f"no Gloo library in horovod's build tree {build}: run `make install`"
    library = libraries[0]
    flags = (library.parent / "CMakeFiles/compatible17_gloo.dir/flags.make").read_text()
    wanted = re.findall(r"^CXX_(?:DEFINES|INCLUDES) = (.*)$", flags, flags=re.MULTILINE)
    return library, shlex.split(" ".join(wanted))


def same_on_every_rank(results: list[dict], key: str):
    """``key`` of every rank's result, which must be the same on all of them."""
    assert all(r[key] == results[0][key] for r in results), [r[key] for r in results]
    return results[0][key]


def run_fresh(argv: list[str], timeout_s: float = 180, join_ray: bool = False) -> str:
    """Runs ``argv`` as a new process in the repository's folder (no Ray of ours in it;
    with ``join_ray``, RAY_ADDRESS names this process's, for a ``run()``, ``ray.init()``,
    example or ``horovod-ray run`` there to join instead of starting one); returns its
    stdout, and fails the test on a non-zero exit with the end of its stderr."""
    env = dict(os.environ)
    if join_ray:
        env["RAY_ADDRESS"] = _this_cluster()
    result = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def run_fresh_python(code: str, timeout_s: float = 180, join_ray: bool = False) -> str:
    """run_fresh for ``python -c code`` in this environment's interpreter."""
    return run_fresh([sys.executable, "-c", code], timeout_s, join_ray)


# README.rst (the front page) and the documentation's pages, whose snippets all run in tests.
DOC_FILES = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]


def doc_blocks(language: str) -> list[str]:
    """The code blocks in ``language`` of README.rst and docs/*.rst, unindented, each once
    (README's quickstart is also the docs'), in file order."""
    pattern = rf"^\.\. code-block:: {language}\n\n((?:(?:    .*)?\n)+)"
    blocks: dict[str, None] = {}
    for path in DOC_FILES:
        for block in re.findall(pattern, path.read_text(), flags=re.MULTILINE):
            blocks[re.sub(r"^    ", "", block, flags=re.MULTILINE).rstrip() + "\n"] = None
    return list(blocks)


def _this_cluster() -> str:
    # The state API would otherwise look for Ray instances on this machine and stop at
    # any other one (another test run, a user's Ray).
    return ray.get_runtime_context().gcs_address


def alive_actors() -> list:
    return ray_state.list_actors(
        address=_this_cluster(), filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    )


def all_actors() -> list:
    """Every actor this cluster has had, dead ones included."""
    return ray_state.list_actors(
        address=_this_cluster(), limit=10_000, raise_on_missing_output=False
    )


def all_placement_groups() -> list:
    """Every placement group this cluster has had, removed ones included."""
    return ray_state.list_placement_groups(
        address=_this_cluster(), limit=10_000, raise_on_missing_output=False
    )


def live_placement_groups() -> list:
    """The groups not removed, however many this cluster has had: Ray lists 100 unless
    told more, and filtered after that limit the live ones past the 100th went unseen."""
    return ray_state.list_placement_groups(
        address=_this_cluster(),
        filters=[("state", "!=", "REMOVED")],
        limit=10_000,
        raise_on_missing_output=False,
    )


@contextlib.contextmanager
def ctrl_c_once() -> Iterator[tuple]:
    """(a callback that sends SIGINT to the main thread the first time it is called, the
    event set then), with Python's SIGINT handler meanwhile, as a terminal's Ctrl-C: it
    cuts short the wait the main thread is in (``interrupt_main()`` would only mark it for
    the first Python line after that wait), even where the run was started with SIGINT
    ignored (a shell's background job)."""
    interrupted, closed = threading.Event(), threading.Event()

    def interrupt(_item: object) -> None:
        if not interrupted.is_set() and not closed.is_set():  # never after the block
            interrupted.set()
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield interrupt, interrupted
    finally:
        closed.set()
        signal.signal(signal.SIGINT, previous)


def assert_two_attempts_spent(error: BaseException, rank: int) -> None:
    """``error`` is a job's after two failed attempts (max_restarts=1), each attempt's
    cause under its heading, the last one's failed ``rank`` named."""
    text = str(error)
    assert text.startswith("the job failed 2 times (max_restarts=1); each attempt:")
    first, second = text.index("--- attempt 0:"), text.index("--- attempt 1:")
    assert "bad batch in attempt 0" in text[first:second]
    assert "bad batch in attempt 1" in text[second:]
    assert list(error.failures) == [rank]


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.2):
    """Polls ``predicate`` until it returns a truthy value; returns the last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


@pytest.fixture(scope="module", autouse=True)
def _modules_give_the_shared_ray_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that ends with the shared local Ray's CPUs still taken has that Ray shut
    down, so that the next module starts a whole one, and says so in a warning naming
    what Ray still lists (actors, groups, tasks): one leak is one warning where it was
    made, not a placement timeout in every later module. A warning, not a failure: the
    leak seen on CI (2 CPUs, nothing listed holding them) is not yet found, and its
    modules' own checks (``no_leaks``) pass."""
    yield
    kind = _current["kind"]
    if not (ray.is_initialized() and isinstance(kind, tuple) and kind[0] == "local"):
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    if wait_until(lambda: ray.available_resources().get("CPU", 0.0) >= total, 30):
        return
    free = ray.available_resources().get("CPU", 0.0)
    address = _this_cluster()
    held = [
        *(f"actor {a.class_name} {a.state}" for a in all_actors() if a.state != "DEAD"),
        *(f"group {g.placement_group_id[:8]} {g.state}" for g in live_placement_groups()),
        *(
            f"task {t.name} {t.state}"
            for t in ray_state.list_tasks(
                address=address, limit=10_000, raise_on_missing_output=False
            )
            if t.state not in ("FINISHED", "FAILED")
        ),
    ]
    held.extend(_busy_workers(address))
    placeable = _placeable(int(total))
    _shutdown()
    warnings.warn(
        f"{request.module.__name__} left {total - free:g} of {total:g} CPUs of the shared "
        f"Ray taken (Ray restarted for the next module); Ray lists: {held or 'nothing'}; "
        f"a group of all {total:g} CPUs {placeable}",
        stacklevel=1,
    )


def _busy_workers(address: str) -> list[str]:
    """The worker processes alive and not idle (Ray titles an idle one ``ray::IDLE``)."""
    import psutil

    busy = []
    workers = ray_state.list_workers(
        address=address, limit=10_000, detail=True, raise_on_missing_output=False
    )
    for worker in workers:
        if not worker.is_alive or worker.worker_type != "WORKER":
            continue
        try:
            title = " ".join(psutil.Process(worker.pid).cmdline())[:80]
        except psutil.Error:
            continue
        if "IDLE" not in title:
            busy.append(f"worker pid {worker.pid} {title!r}")
    return busy


def _placeable(cpus: int) -> str:
    """Whether Ray can place ``cpus`` one-CPU bundles now (its count of free CPUs may lag
    behind what its raylet has): tells a count that is behind from CPUs held."""
    group = ray.util.placement_group([{"CPU": 1}] * cpus)
    try:
        ready, _ = ray.wait([group.ready()], timeout=10)
        return "was placed" if ready else "could not be placed in 10 s"
    finally:
        ray.util.remove_placement_group(group)


@pytest.fixture
def no_leaks(ray_4cpu) -> Iterator[None]:
    """Fails the test if it leaves alive actors or placement groups behind."""
    actors_before = {a.actor_id for a in alive_actors()}
    groups_before = {g.placement_group_id for g in live_placement_groups()}
    yield
    assert wait_until(lambda: not ({a.actor_id for a in alive_actors()} - actors_before)), (
        f"actors left alive: {alive_actors()}"
    )
    assert wait_until(
        lambda: not ({g.placement_group_id for g in live_placement_groups()} - groups_before)
    ), f"placement groups left: {live_placement_groups()}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        metavar="FILE",
        help="write each test's wall time and the machine's busy CPU time during it (all "
        "cores, from /proc/stat) to FILE as tab-separated lines: where a test waits",
    )


def _busy_cpu_s() -> float:
    """The machine's CPU time spent busy since boot (every core, /proc/stat), in seconds."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    report = item.config.getoption("--cpu-report")
    if not report:
        yield
        return
    wall, busy = time.monotonic(), _busy_cpu_s()
    yield
    wall, busy = time.monotonic() - wall, _busy_cpu_s() - busy
    share = busy / max(wall, 1e-3) / os.cpu_count()
    with open(report, "a") as out:
        out.write(f"{wall:.2f}\t{busy:.2f}\t{share:.2f}\t{item.nodeid}\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Undoes bench.harness.common's RAY_TRAIN_V2_ENABLED=0 once the modules are imported: the
    processes and Rays the tests start have Ray Train v2 (``ray.train.ValidationConfig``),
    as a user's do."""
    if _TRAIN_V2 is None:
        os.environ.pop("RAY_TRAIN_V2_ENABLED", None)
    else:
        os.environ["RAY_TRAIN_V2_ENABLED"] = _TRAIN_V2


@pytest.fixture
def fresh_rank_session():
    """A rank session of the test's own (no upload thread, channel or notice yet); the
    one before is given back after."""
    from horovod_ray.rank import session

    with session.installed(session.RankSession()) as installed:
        yield installed
