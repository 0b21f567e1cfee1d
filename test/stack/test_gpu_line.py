"""The GPU lines (``make install GPU=1``: PyTorch's CUDA 13 build; ``GPU=tf``: TensorFlow's
CUDA 12 build; horovod with NCCL on both) on a machine without a GPU or its driver, and
``make test-gpu``'s script (bench/tools/gpu_check.py) on CPU ranks. ``make test GPU=1`` and
``make test GPU=tf`` run this module in their line's environment, where the build's tests
run; on the CPU lines they are skipped and the script's run on CPU ranks (its checks and,
with PyTorch, its peer, with Gloo) is still checked, for each framework installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import ray

from horovod_ray.stack.build import _extension, installed_version, nccl_in_build, nccl_version
from test.conftest import ROOT, run_fresh_python, start_local_ray

pytestmark = pytest.mark.gpu_line

gpu_build = pytest.mark.skipif(
    not nccl_in_build(), reason="horovod without NCCL: a GPU line's (make test GPU=1, GPU=tf)"
)
# The framework a GPU line builds horovod for: PyTorch (GPU=1) or TensorFlow (GPU=tf).
GPU_FRAMEWORK = "torch" if importlib.util.find_spec("torch") else "tensorflow"


def _nccl_wheel() -> str:
    """The release of the NCCL wheel a GPU line links: CUDA 13's with PyTorch, 12's with
    TensorFlow."""
    version = installed_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    assert version is not None, "no NCCL wheel is installed"
    return version


@pytest.mark.unit
@gpu_build
def test_the_build_has_the_nccl_wheels_release_and_cuda():
    out = run_fresh_python(
        f"import horovod.{GPU_FRAMEWORK} as hvd\nprint(hvd.nccl_built(), hvd.cuda_built())"
    )
    nccl = _nccl_wheel()  # 2.30.7 -> 23007
    major, minor, patch = (int(part) for part in nccl.split("."))
    assert out.split() == [str(major * 10000 + minor * 100 + patch), "True"]
    assert nccl_version(major * 10000 + minor * 100 + patch) == nccl
    # Linked to the wheel's libnccl.so.2 (HOROVOD_NCCL_LINK=SHARED), not a static copy.
    dynamic = subprocess.run(
        ["readelf", "-d", _extension()], capture_output=True, text=True, check=True
    ).stdout
    assert "[libnccl.so.2]" in dynamic
    if GPU_FRAMEWORK == "tensorflow":
        # Found in the wheel beside horovod wherever the environment is
        # (patches/gpu-tf/horovod-0.28.1-tf-nccl-wheel-rpath.patch), not where it was built.
        assert "Library runpath: [$ORIGIN/../../nvidia/nccl/lib]" in dynamic


@pytest.mark.unit
@gpu_build
@pytest.mark.skipif(GPU_FRAMEWORK != "torch", reason="the PyTorch GPU line's (GPU=1)")
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


@pytest.mark.unit
@gpu_build
@pytest.mark.skipif(GPU_FRAMEWORK != "tensorflow", reason="the TensorFlow GPU line's (GPU=tf)")
def test_horovod_tensorflow_imports_and_reduces_on_cpu_without_a_gpu():
    # TensorFlow's GPU build on a machine without the driver: it logs that CUDA did not
    # start and runs on the CPU; horovod's NCCL build joins and reduces CPU tensors.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tensorflow as tf\n"
            "assert tf.test.is_built_with_cuda() and not tf.config.list_physical_devices('GPU')\n"
            "import horovod.tensorflow as hvd\n"
            "hvd.init()\n"
            "print(hvd.allreduce(tf.ones(3), op=hvd.Sum).numpy().tolist())\n",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        # No GPU here; none shown where there is one.
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[1.0, 1.0, 1.0]"
    # The message a user without a driver sees, once, rather than a crash.
    assert "failed call to cuInit" in done.stderr


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    """bench/tools/gpu_check.py joining this module's local Ray, as ``make test-gpu`` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "bench.tools.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address},
    )


@pytest.mark.parametrize(
    ("framework", "peer"),
    [("torch", ", torch.distributed "), ("tensorflow", " (TensorFlow: no peer in this check)")],
)
def test_the_gpu_check_runs_every_check_on_cpu_ranks(framework, peer):
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not on this line")
    start_local_ray(4)
    done = _gpu_check("--framework", framework, "--device", "cpu", "--mb", "1", "--iters", "3")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    checks = [line for line in lines if line.startswith("rank ") and line.endswith(": ok")]
    assert len(checks) == 10  # 5 checks on each of 2 ranks
    assert lines[-1] == "gpu_check: ok"
    assert "on 2 rank(s): horovod " in lines[-2] and peer in lines[-2]
    built = "horovod built without NCCL, without CUDA"
    if nccl_in_build():  # a GPU line's build, running its collectives over Gloo here
        built = f"horovod built with NCCL {_nccl_wheel()} and CUDA"
    assert lines[0] == f"rank 0: cpu; {built}"


def test_the_gpu_check_without_a_gpu_exits_2_and_names_the_way():
    start_local_ray(4)  # Ray's own count: no GPU
    done = _gpu_check()
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "Ray sees no GPU on this machine" in done.stderr and "--device cpu" in done.stderr
