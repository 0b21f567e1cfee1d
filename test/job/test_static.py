"""A static job's typed records, without Ray: the rank table the executor logs at start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from horovod_ray.job.static import Member, table
from horovod_ray.rank.assignment import WorkerRecord, assign_ranks
from horovod_ray.rank.network import NodeFacts

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def test_the_rank_table_has_a_line_per_rank_in_world_rank_order():
    records = [
        WorkerRecord("node-b", ("1",)),
        WorkerRecord("node-a"),
        WorkerRecord("node-b", ("0",)),
    ]
    ips = {"node-a": "10.0.0.1", "node-b": "10.0.0.2"}
    members = sorted(
        (
            Member(None, info, NodeFacts(info.node_id, ips[info.node_id], "eth0", "lo", ()))
            for info in assign_ranks(records)
        ),
        key=lambda m: m.rank.world_rank,
    )
    lines = table(tuple(members)).splitlines()
    assert lines[0].split() == ["rank", "local", "cross", "node", "ip", "gpus"]
    rows = [line.split() for line in lines[1:]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    by_node = {row[3]: row for row in rows}
    assert by_node["node-a"][1:3] == ["0/1", "0/2"] or by_node["node-a"][1:3] == ["0/1", "1/2"]
    assert {row[4] for row in rows} == {"10.0.0.1", "10.0.0.2"}
    # Each node's ranks see the node's GPUs; a node without GPUs shows '-'.
    assert by_node["node-a"][5] == "-"
    assert {row[5] for row in rows if row[3] == "node-b"} == {"0,1"}


def test_a_static_job_does_not_load_horovods_elastic_driver():
    """The elastic kind is imported for an elastic job only (kinds.create)."""
    code = (
        "import sys; from horovod_ray import RayExecutor; RayExecutor(num_workers=2); "
        "print(sorted(m for m in ('horovod_ray.job.elastic', 'horovod_ray.job.elastic_run', "
        "'horovod.runner.elastic.driver') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
