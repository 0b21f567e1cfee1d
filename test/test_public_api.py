"""The public surface, as a user reaches it: every name a user imports still imports, and the
command line starts both ways. Subprocesses only, no Ray."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

# What users import, as README.rst and docs/ show it. A name that moves or goes must fail here.
PUBLIC = {
    "horovod_ray": [
        "Callback",
        "ConfigError",
        "DataConfig",
        "DatasetNotFoundError",
        "ElasticRayExecutor",
        "ElasticLimitError",
        "ExecutorState",
        "ExecutorStateError",
        "HangError",
        "HorovodRayError",
        "NodeDrainingError",
        "PlacementTimeoutError",
        "RankError",
        "RayExecutor",
        "RendezvousError",
        "Settings",
        "StartCancelledError",
        "WorkerFailedError",
        "__version__",
        "attempt",
        "get_checkpoint",
        "log",
        "report",
        "run",
        "CheckpointError",
        "Result",
        "JobStatus",
        "jobs",
        "TrainContext",
        "get_context",
        "get_dataset_shard",
        "get_preemption_info",
        "get_all_reported_checkpoints",
        "HorovodTrainer",
    ],
    "horovod_ray.errors": [
        "CheckpointError",
        "ConfigError",
        "ElasticLimitError",
        "ExecutorStateError",
        "HangError",
        "HorovodRayError",
        "NodeDrainingError",
        "PlacementTimeoutError",
        "RankError",
        "RendezvousError",
        "StartCancelledError",
        "WorkerFailedError",
    ],
    "horovod_ray.executor": ["RayExecutor"],
    "horovod_ray.trainer.horovod_trainer": ["HorovodTrainer"],
    "horovod_ray.elastic": [
        "ElasticRayExecutor",
        "RayHostDiscovery",
        "TestDiscovery",
        "HostChange",
    ],
    "horovod_ray.ray_logger": ["log"],
    "horovod_ray.settings": ["Settings", "create_settings"],
    "horovod_ray.run": ["run"],
    "horovod_ray.tune": ["DistributedTrainableCreator"],
}


@pytest.mark.parametrize(
    "module, name", [(module, name) for module, names in PUBLIC.items() for name in names]
)
def test_every_public_name_imports(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_the_package_lists_exactly_its_public_names():
    import horovod_ray
    import horovod_ray.tune

    assert sorted(horovod_ray.__all__) == sorted(PUBLIC["horovod_ray"])
    assert horovod_ray.tune.__all__ == PUBLIC["horovod_ray.tune"]


def test_the_executor_is_one_class_under_both_names():
    import horovod_ray
    from horovod_ray.executor import RayExecutor

    assert horovod_ray.RayExecutor is RayExecutor


def _help(argv: list[str]) -> str:
    env = {**os.environ, "RAY_ADDRESS": ""}  # --help must not look for a cluster
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_python_dash_m_and_the_console_script_are_one_command_line():
    by_module = _help([sys.executable, "-m", "horovod_ray", "run", "--help"])
    script = Path(sys.executable).with_name("horovod-ray")
    assert script.exists(), "the horovod-ray entry point is not installed (make install)"
    assert _help([str(script), "run", "--help"]) == by_module
    assert "usage: horovod-ray run" in by_module and "-np N" in by_module
