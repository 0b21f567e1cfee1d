"""horovod_ray.output: the markers that tell when the workers' output has all arrived.

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
from horovod_ray import output
from horovod_ray.output import MARKER, Markers
from test.conftest import start_local_ray

pytestmark = pytest.mark.timeout(120)


def test_markers_are_taken_out_and_noted():
    markers = Markers()
    token = markers.new_token()
    lines = ["a", f"{MARKER}{token}:0", "b", f"{MARKER}{token}:1"]
    assert markers.take_out(lines) == ["a", "b"]
    assert markers.wait(token, 2, timeout_s=0)


def test_a_last_line_without_newline_is_kept_in_front_of_its_marker():
    markers = Markers()
    token = markers.new_token()
    assert markers.take_out([f"loss 0.5{MARKER}{token}:0"]) == ["loss 0.5"]
    assert markers.wait(token, 1, timeout_s=0)


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
    assert not markers.wait(token, 1, timeout_s=0)


def test_a_wait_ends_when_the_last_marker_arrives_or_at_its_timeout():
    markers = Markers()
    token = markers.new_token()
    arrive = threading.Timer(0.05, markers.take_out, args=([f"{MARKER}{token}:1"],))
    arrive.start()
    assert markers.take_out([f"{MARKER}{token}:0"]) == []
    assert markers.wait(token, 2, timeout_s=30)
    assert not markers.wait(token, 3, timeout_s=0.01)


def _logs_dir() -> str:
    return ray._private.worker._global_node.get_logs_dir_path()  # noqa: SLF001


def _worker_logs() -> list[str]:
    return glob.glob(os.path.join(_logs_dir(), "worker-*.out"))


def test_a_flush_with_nothing_forwarded_writes_nothing(ray_4cpu):
    # The fixture's Ray has log_to_driver=False: no worker line comes to this process.
    assert not output.forwarded()
    sizes = {path: os.path.getsize(path) for path in _worker_logs()}
    assert sizes
    assert output.flush(_logs_dir())
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
    assert output.flush(_logs_dir())
    # Every line written before the flush has been printed when it returns...
    printed = capfd.readouterr()
    assert "SHOUT before the flush" in printed.out
    assert MARKER not in printed.out + printed.err
    # ...and each worker's log file, that task's among them, ends with a marker.
    (shouter,) = [path for path in _worker_logs() if path.endswith(f"-{pid}.out")]
    with open(shouter, encoding="utf-8") as log:
        assert log.read().splitlines()[-1].startswith(MARKER)
    assert horovod_ray.run(os.getpid, num_slots=1)  # Ray is still usable after a flush
