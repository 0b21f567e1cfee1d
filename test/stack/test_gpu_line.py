"""The GPU line (``make install GPU=1``: PyTorch's CUDA 13 build, horovod with NCCL) on a
machine without a GPU or its driver, and ``make test-gpu``'s script (bench/gpu_check.py)
on CPU ranks. ``make test GPU=1`` runs this module in the GPU line's environment, where
every test runs; on the TensorFlow lines the build's own tests are skipped and the
script's run on CPU ranks (its checks and its peer, with Gloo) is still checked."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import ray

from horovod_ray.stack.build import _extension, nccl_in_build, nccl_version
from test.conftest import ROOT, run_fresh_python, start_local_ray

pytestmark = pytest.mark.gpu_line

gpu_build = pytest.mark.skipif(
    not nccl_in_build(), reason="horovod without NCCL: the GPU line's (make test GPU=1)"
)


@pytest.mark.unit
@gpu_build
def test_the_build_has_the_nccl_wheels_release_and_cuda():
    out = run_fresh_python("import horovod.torch as hvd\nprint(hvd.nccl_built(), hvd.cuda_built())")
    nccl = importlib.metadata.version("nvidia-nccl-cu13")  # 2.30.7 -> 23007
    major, minor, patch = (int(part) for part in nccl.split("."))
    assert out.split() == [str(major * 10000 + minor * 100 + patch), "True"]
    assert nccl_version(major * 10000 + minor * 100 + patch) == nccl
    # Linked to the wheel's libnccl.so.2 (HOROVOD_NCCL_LINK=SHARED), not a static copy.
    dynamic = subprocess.run(
        ["readelf", "-d", _extension()], capture_output=True, text=True, check=True
    ).stdout
    assert "[libnccl.so.2]" in dynamic


@pytest.mark.unit
@gpu_build
def test_horovod_torch_imports_and_reduces_on_cpu_without_a_gpu():
    # No GPU here (none shown where there is one): the CUDA build imports, joins and
    # reduces CPU tensors.
    out = run_fresh_python(
        "import os\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = ''\n"
        "import torch\n"
        "assert not torch.cuda.is_available()\n"
        "import horovod.torch as hvd\n"
        "hvd.init()\n"
        "print(hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist())\n"
    )
    assert out.strip() == "[1.0, 1.0, 1.0]"


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    """bench/gpu_check.py joining this module's local Ray, as ``make test-gpu`` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address},
    )


def test_the_gpu_check_runs_every_check_on_cpu_ranks():
    start_local_ray(4)
    done = _gpu_check("--device", "cpu", "--mb", "1", "--iters", "3")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    checks = [line for line in lines if line.startswith("rank ") and line.endswith(": ok")]
    assert len(checks) == 10  # 5 checks on each of 2 ranks
    assert lines[-1] == "gpu_check: ok"
    assert "on 2 rank(s): horovod " in lines[-2] and ", torch.distributed " in lines[-2]
    built = "horovod built without NCCL, without CUDA"
    if nccl_in_build():  # the GPU line's build, running its collectives over Gloo here
        built = f"horovod built with NCCL {importlib.metadata.version('nvidia-nccl-cu13')} and CUDA"
    assert lines[0] == f"rank 0: cpu; {built}"


def test_the_gpu_check_without_a_gpu_exits_2_and_names_the_way():
    start_local_ray(4)  # Ray's own count: no GPU
    done = _gpu_check()
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "Ray sees no GPU on this machine" in done.stderr and "--device cpu" in done.stderr
