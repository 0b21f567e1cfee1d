"""``horovod_ray.get_context()`` on the ranks of each entry point: ``run()``,
``RayExecutor``, a command of ``horovod-ray run`` (Tune's: test/tune/test_trainable.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray

import horovod_ray
from horovod_ray import HorovodRayError, RayExecutor
from test.conftest import start_local_ray


def context_now(_=None) -> dict:
    """Every number and name the context has, before and after hvd.init()."""
    import horovod.torch as hvd

    import horovod_ray

    context = horovod_ray.get_context()

    def numbers() -> tuple:
        return (
            context.get_world_rank(),
            context.get_world_size(),
            context.get_local_rank(),
            context.get_local_world_size(),
            context.get_node_rank(),
        )

    before = numbers()
    hvd.init()
    storage = context.get_storage()
    return {
        "before": before,
        "after": numbers(),
        "name": context.get_experiment_name(),
        "run_path": None if storage is None else storage.run_path,
    }


def test_run_and_the_executor_give_each_rank_its_context(ray_4cpu, tmp_path):
    ran = horovod_ray.run(context_now, num_slots=2, storage_path=str(tmp_path), name="ctx")
    for rank, seen in enumerate(ran):
        assert seen["before"] == seen["after"] == (rank, 2, rank, 2, 0)
        assert (seen["name"], seen["run_path"]) == ("ctx", str(tmp_path / "ctx"))
    with RayExecutor(num_workers=2) as executor:
        executed = executor.execute(context_now)
    assert [seen["after"] for seen in executed] == [(0, 2, 0, 2, 0), (1, 2, 1, 2, 0)]
    assert {(seen["name"], seen["run_path"]) for seen in executed} == {("job", None)}


SCRIPT = """
import json
import horovod.torch as hvd
import horovod_ray

hvd.init()
context = horovod_ray.get_context()
print(json.dumps([context.get_world_rank(), context.get_world_size(),
                  context.get_node_rank(), context.get_experiment_name()]))
"""


def test_a_command_lines_rank_has_its_context(tmp_path):
    start_local_ray(4)
    script = tmp_path / "ctx_script.py"
    script.write_text(SCRIPT)
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, "-m", "horovod_ray", "run", "--address", address, "-np", "2",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split(":", 1)[1] for line in out.stdout.splitlines() if "<stdout>:[" in line]
    assert sorted(json.loads(line) for line in lines) == [
        [0, 2, 0, "ctx_script.py"],
        [1, 2, 0, "ctx_script.py"],
    ]


@pytest.mark.unit
def test_outside_a_job_the_context_says_where_it_answers(monkeypatch):
    monkeypatch.delenv("HOROVOD_RAY_JOB_ID", raising=False)
    with pytest.raises(HorovodRayError, match="on a rank of a horovod_ray job"):
        horovod_ray.get_context()
