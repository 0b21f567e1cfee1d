"""``run(..., local=True)``: the function in the caller's process as a job of one rank,
without Ray: a scripted debugger session stops in it, and report, get_checkpoint,
get_context and the callbacks work as on a rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

import horovod_ray
from horovod_ray import ConfigError

DEBUGGED = """
import horovod_ray

def train(x):
    import pdb
    import horovod.torch as hvd

    hvd.init()
    secret = x * 7
    pdb.set_trace()
    return secret + hvd.size()

print("result", horovod_ray.run(train, args=[6], local=True))
"""


def test_a_local_run_stops_at_a_breakpoint():
    session = subprocess.run(
        [sys.executable, "-c", DEBUGGED],
        input="p secret\np horovod_ray.get_context().get_world_size()\nc\n",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert session.returncode == 0, session.stderr[-3000:]
    out = session.stdout
    assert "(Pdb) 42\n(Pdb) 1\n(Pdb) " in out, out[-3000:]
    assert out.rstrip().endswith("result [43]")


RESUMED = """
import tempfile
import threading
from pathlib import Path

from ray.train import Checkpoint

import horovod_ray

def train(steps, validation=False):
    import horovod.torch as hvd
    import torch

    hvd.init()
    context = horovod_ray.get_context()
    start = 0
    if (checkpoint := horovod_ray.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "step").read_text())
    for step in range(start + 1, start + steps + 1):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text(str(step))
            checkpoint = Checkpoint.from_directory(folder)
            horovod_ray.report({"step": step}, checkpoint=checkpoint, validation=validation)
    total = float(hvd.allreduce(torch.ones(1), op=hvd.Sum))
    notice = horovod_ray.get_preemption_info()  # nothing drains under a local run
    return start, total, context.get_world_rank(), context.get_experiment_name(), notice

storage, heard = tempfile.mkdtemp(), []
first = horovod_ray.run(train, args=[2], local=True, storage_path=storage, name="here",
                        callbacks=[heard.append])
import os

import ray
from ray.train import ValidationConfig

def validate(checkpoint):  # in a thread of this process
    return {"validated_in": os.getpid(), "thread": threading.current_thread().name}

second = horovod_ray.run(train, args=[2, True], local=True, storage_path=storage, name="here",
                         validation_config=ValidationConfig(validate))
validated = [
    (m["step"], m["validated_in"] == os.getpid(), m["thread"])
    for _, m in horovod_ray.Result.from_path(f"{storage}/here").best_checkpoints
    if "thread" in m
]

def broken():
    raise ValueError("a bug")

try:
    horovod_ray.run(broken, local=True, storage_path=storage, name="here")
except ValueError:
    pass
try:
    horovod_ray.get_context()
except horovod_ray.HorovodRayError:
    outside = "no context"
left = sorted(key for key in os.environ if key.startswith("HOROVOD_"))
print(first, second, heard, validated)
print(ray.is_initialized(), threading.active_count(), outside, left)
"""


def test_a_local_run_reports_persists_and_resumes_without_ray():
    out = subprocess.run(
        [sys.executable, "-c", RESUMED], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # No Ray, no thread, no context and none of the rank's variables left after each run
    # (the last one raised).
    # The second run's validations ran in this process, in threads that have ended.
    assert out.stdout.splitlines()[-2:] == [
        "[(0, 1.0, 0, 'here', None)] [(2, 1.0, 0, 'here', None)] [{'step': 1}, {'step': 2}] "
        "[(3, True, 'horovod_ray-validate'), (4, True, 'horovod_ray-validate')]",
        "False 1 no context []",
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"num_slots": 2}, "num_slots"),
        ({"num_hosts": 2}, "num_hosts"),
        ({"min_workers": 1}, "min_workers"),
        ({"max_restarts": 1}, "max_restarts"),
        ({"local": "yes"}, "local"),
    ],
)
def test_a_local_run_refuses_more_than_one_rank(kwargs, parameter):
    with pytest.raises(ConfigError) as raised:
        horovod_ray.run(len, args=[[]], **{"local": True, **kwargs})
    assert raised.value.parameter == parameter


def _reports_around_a_local_run(inner_storage: str, init: bool = False) -> list:
    """A rank reports, runs a function with run(local=True) and its own storage, and
    reports again; with ``init``, after hvd.init() (each rank's local run then has a
    storage of its own)."""
    import os
    import tempfile
    from pathlib import Path

    from ray.train import Checkpoint

    import horovod_ray

    if init:
        import horovod.torch as hvd

        hvd.init()
        inner_storage = os.path.join(inner_storage, f"rank{hvd.rank()}")

    def report(text: str) -> None:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "text").write_text(text)
            horovod_ray.report({"text": text}, checkpoint=Checkpoint.from_directory(folder))

    report("outer 1")
    inner = horovod_ray.run(
        lambda: report("inner"), local=True, storage_path=inner_storage, name="inner"
    )
    report("outer 2")
    return inner


def test_a_local_run_inside_a_rank_keeps_its_checkpoints_apart(ray_4cpu, tmp_path):
    """The rank's upload thread took the inner run's checkpoint into the enclosing run,
    where it became the latest (what that job would resume from), and the inner run got
    nothing."""
    from pathlib import Path

    outer, inner = tmp_path / "outer", tmp_path / "inner"
    assert horovod_ray.run(
        _reports_around_a_local_run, args=[str(inner)], storage_path=str(outer), name="outer"
    ) == [[None]]

    def texts(run: Path) -> list[str]:
        best = horovod_ray.Result.from_path(str(run)).best_checkpoints
        return [Path(checkpoint.path, "text").read_text() for checkpoint, _ in best]

    assert texts(outer / "outer") == ["outer 1", "outer 2"]
    assert texts(inner / "inner") == ["inner"]


def test_every_ranks_local_run_keeps_its_checkpoints(ray_4cpu, tmp_path):
    """After the enclosing job's hvd.init(), rank 1's local run took its reports for rank
    1's, and dropped them."""
    from pathlib import Path

    outer, inner = tmp_path / "outer", tmp_path / "inner"
    horovod_ray.run(
        _reports_around_a_local_run,
        args=[str(inner), True],
        num_slots=2,
        storage_path=str(outer),
        name="outer",
    )
    for rank in (0, 1):
        ((checkpoint, _),) = horovod_ray.Result.from_path(
            str(inner / f"rank{rank}" / "inner")
        ).best_checkpoints
        assert Path(checkpoint.path, "text").read_text() == "inner"
