"""What a process leaves in its node's temporary folder, swept once its process is gone,
never while it lives, in this process-id space or another's (a container sharing the
folder); no Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from horovod_ray.checkpoints import leftovers

pytestmark = pytest.mark.unit

PREFIX = "horovod_ray-upload-"

# A process that holds a lock file named for ``pid``, as one of this package's processes
# in another process-id space would, until its standard input closes.
HOLDER = """
import fcntl, os, sys, tempfile
descriptor, _ = tempfile.mkstemp(prefix=f"horovod_ray-alive-{sys.argv[2]}-", dir=sys.argv[1])
fcntl.flock(descriptor, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _gone_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_folder_whose_process_lives_in_another_pid_space_stays(tmp_path):
    """Its number names no process here: looked for by number, it was taken for gone and
    its folder removed while it was written."""
    pid = _gone_pid()
    folder = tmp_path / f"{PREFIX}{pid}-abc"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), str(pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        assert leftovers.sweep_stale((PREFIX,), str(tmp_path)) == []
        assert folder.exists()
    finally:
        holder.stdin.close()
        holder.wait(30)
    # Gone now: the folder goes, and the lock file it left.
    assert leftovers.sweep_stale((PREFIX,), str(tmp_path)) == [folder.name]
    assert os.listdir(tmp_path) == []


def test_this_processs_own_and_an_older_versions_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(leftovers, "_held", None)  # this process's lock, taken in tmp_path
    leftovers.hold_alive_lock(str(tmp_path))
    try:
        mine = tmp_path / f"{PREFIX}{os.getpid()}-mine"
        old_gone = tmp_path / f"{PREFIX}{_gone_pid()}-old"  # no lock: looked for by number
        other = tmp_path / "other-1-x"
        for folder in (mine, old_gone, other):
            folder.mkdir()
        assert leftovers.sweep_stale((PREFIX,), str(tmp_path)) == [old_gone.name]
        (lock,) = [name for name in os.listdir(tmp_path) if name.startswith("horovod_ray-alive-")]
        assert lock.startswith(f"horovod_ray-alive-{os.getpid()}-")
        assert sorted(os.listdir(tmp_path)) == sorted([lock, mine.name, other.name])
    finally:
        os.close(leftovers._held[1])
