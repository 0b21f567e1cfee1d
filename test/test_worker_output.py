"""horovod_ray.worker_output: the markers that tell when the workers' output has all arrived.

The exit of a script whose local Ray run() started is tested in test_run.py.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Iterator

import pytest
import ray

import horovod_ray
from horovod_ray import worker_output
from horovod_ray.worker_output import MARKER, Markers, serves_job
from test.conftest import start_local_ray

pytestmark = pytest.mark.timeout(120)


def test_markers_are_taken_out_and_noted():
    markers = Markers()
    token = markers.new_token()
    lines = ["a", f"{MARKER}{token}:0", "b", f"{MARKER}{token}:1"]
    assert markers.take_out(lines) == ["a", "b"]
    assert markers.wait(token, 2, timeout_s=0) == 2


def test_a_last_line_without_newline_is_kept_in_front_of_its_marker():
    markers = Markers()
    token = markers.new_token()
    lines = [f"loss 0.5{MARKER}{token}:0", f"says {MARKER}{MARKER}{token}:1"]
    assert markers.take_out(lines) == ["loss 0.5", f"says {MARKER}"]
    assert markers.wait(token, 2, timeout_s=0) == 2


@pytest.mark.parametrize(
    "line",
    [
        f"{MARKER}0123:0",  # a token this process never wrote
        f"{MARKER}TOKEN:x",  # not a marker's number
        f"{MARKER}TOKEN",
        "horovod_ray-output-flushed",
    ],
)
def test_lines_that_are_not_this_process_markers_are_printed(line):
    markers = Markers()
    token = markers.new_token()
    line = line.replace("TOKEN", token)
    assert markers.take_out([line]) == [line]
    assert markers.wait(token, 1, timeout_s=0) == 0


def test_a_wait_ends_when_the_last_marker_arrives_or_at_its_timeout():
    markers = Markers()
    token = markers.new_token()
    arrive = threading.Timer(0.05, markers.take_out, args=([f"{MARKER}{token}:1"],))
    arrive.start()
    assert markers.take_out([f"{MARKER}{token}:0"]) == []
    assert markers.wait(token, 2, timeout_s=30) == 2
    assert markers.wait(token, 3, timeout_s=0.01) == 2


W = "worker-6f5905e1"  # a worker id, shortened


@pytest.mark.parametrize(
    ("name", "head", "marked"),
    [
        (f"{W}-01000000-6868.out", None, True),  # named for this job: head not read
        (f"/tmp/ray/logs/{W}-01000000-6868.err", None, True),
        (f"{W}-02000000-6868.out", None, False),  # another driver's worker
        (f"{W}-ffffffff-6868.out", ":job_id:01000000\n:actor_name:Worker\n", True),
        (f"{W}-ffffffff-6868.out", "a warning\n:job_id:01000000\n", True),
        (f"{W}-ffffffff-6868.out", ":job_id:02000000\n", False),  # went to another job
        (f"{W}-ffffffff-6868.out", "", False),  # never given a job: nothing to wait for
        (f"{W}-ffffffff-6868.out", "print(':job_id:01000000')\n", False),
        ("worker-odd.out", None, False),
    ],
)
def test_a_worker_file_is_marked_only_if_it_serves_this_job(name, head, marked):
    def read_head() -> str:
        assert head is not None, "the file's head was read where the name decides"
        return head

    assert serves_job(name, "01000000", read_head) is marked


def _logs_dir() -> str:
    return ray._private.worker._global_node.get_logs_dir_path()  # noqa: SLF001


def _worker_logs() -> list[str]:
    return glob.glob(os.path.join(_logs_dir(), "worker-*.out"))


def test_a_flush_with_nothing_forwarded_writes_nothing(ray_4cpu):
    # The fixture's Ray has log_to_driver=False: no worker line comes to this process.
    assert not worker_output.forwarded()
    ray.get(ray.remote(lambda: os.getpid()).remote())  # a worker with log files, at least
    sizes = {path: os.path.getsize(path) for path in _worker_logs()}
    assert sizes
    assert worker_output.flush(_logs_dir())
    assert {path: os.path.getsize(path) for path in sizes} == sizes


@pytest.fixture
def ray_forwarding() -> Iterator[None]:
    """A local Ray that forwards its workers' output to this process (Ray's default)."""
    start_local_ray(2, log_to_driver=True)
    yield


def test_a_flush_waits_for_every_worker_file_and_prints_no_marker(ray_forwarding, capfd):
    @ray.remote
    def shout() -> int:
        print("SHOUT before the flush", flush=True)
        return os.getpid()

    pid = ray.get(shout.remote())
    assert worker_output.forwarded()
    assert worker_output.flush(_logs_dir())
    # Every line written before the flush has been printed when it returns...
    printed = capfd.readouterr()
    assert "SHOUT before the flush" in printed.out
    assert MARKER not in printed.out + printed.err
    # ...and that task's log file ends with a marker.
    (shouter,) = [path for path in _worker_logs() if path.endswith(f"-{pid}.out")]
    with open(shouter, encoding="utf-8") as log:
        assert log.read().splitlines()[-1].startswith(MARKER)
    assert horovod_ray.run(os.getpid, num_slots=1)  # Ray is still usable after a flush
