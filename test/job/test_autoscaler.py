"""Elastic jobs on nodes that Ray's own autoscaler launches for them (its fake multi-node
provider: the same autoscaler, each node an extra raylet on this machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test.autoscaling import AutoscalingCluster
from test.conftest import ROOT

pytestmark = pytest.mark.timeout(400)


def test_an_elastic_job_grows_onto_the_nodes_the_autoscaler_launches_for_it(tmp_path):
    """A head without CPUs, up to three 2-CPU nodes: the job's request for 6 ranks makes
    the autoscaler launch them, and the job (min_workers=2), which starts as soon as the
    first is up, ends on 6 ranks, though the others come while its first ranks start
    (without patches/horovod-0.28.1-elastic-early-host-update.patch it ran to its end on
    2). When run() ends its request is withdrawn and the autoscaler removes the idle
    nodes."""
    with AutoscalingCluster(tmp_path, max_nodes=3, cpus_per_node=2) as cluster:
        result = subprocess.run(
            [sys.executable, str(ROOT / "test" / "scripts" / "autoscaled_elastic.py"),
             str(tmp_path)],
            cwd=ROOT, env={**cluster.env, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    sizes = outcome["sizes"]
    assert sizes[-3:] == [6, 6, 6], outcome
    assert outcome["to_max_workers_s"] is not None  # the membership event said so too
    assert outcome["request"] == []
    assert outcome["idle_nodes_gone_s"] is not None
    assert not cluster.pids()
