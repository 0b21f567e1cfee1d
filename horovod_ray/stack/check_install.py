"""``python -m horovod_ray.stack.check_install``: the post-install check of ``make install``.

Asks horovod itself (one probe per framework loads its extension in a subprocess) whether
it was built with TensorFlow and Gloo, and with PyTorch where PyTorch is installed,
exiting non-zero if not; says whether it has NCCL and CUDA (``--gpu torch``, which ``make
install GPU=1`` passes, makes PyTorch, NCCL and CUDA required and TensorFlow optional;
``--gpu tensorflow``, from ``make install GPU=tf``, TensorFlow, NCCL and CUDA), and
whether it carries the Gloo interface fix and, on Keras 3, the Keras 3 port from
``patches/`` (a stock build still runs collectives, with the hostname caveat;
``--require-fix``, which ``make install`` passes, makes the absence of either an error).
"""

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from horovod_ray.stack.build import (  # noqa: E402
    GPU_HINTS,
    TORCH_HINT,
    batched_rendezvous,
    core_counters,
    exchange_allreduce,
    gloo_iface_fixed,
    gloo_loop_waits_for_busy_pairs,
    install_hint,
    keras3_port,
    nccl_version,
    reducescatter_waits_for_its_sends,
    require_gloo,
    sync_batch_norm_on_cpu,
    torch_installed,
    torch_wait_starts_the_cycle,
    torch_waits_without_spinning,
)
from horovod_ray.stack.wheelhouse import is_patched  # noqa: E402


def _gpu_check(gpu: str | None) -> int:
    """What horovod's collectives can do with GPU tensors; with ``gpu``, the GPU line's
    framework, NCCL and CUDA are required, as that line builds them."""
    nccl = horovod_nccl_built()
    cuda = nccl and horovod_cuda_built()
    if nccl and cuda:
        framework = gpu or max(_NAMES, key=lambda f: _probe(f).get("nccl", 0))
        print(
            f"horovod_ray: horovod has NCCL {nccl_version(nccl)} and CUDA "
            f"({_cuda_versions(framework)})"
        )
        return 0
    if gpu:
        print(
            f"horovod_ray: horovod lacks {'NCCL' if not nccl else 'CUDA'}: {GPU_HINTS[gpu]}",
            file=sys.stderr,
        )
        return 1
    print(
        "horovod_ray: horovod has no NCCL (a CPU build: GPU tensors go through host "
        "memory; docs/gpus.rst)"
    )
    return 0


# Run in a fresh interpreter per framework: loads horovod's extension for it (or fails to),
# and prints what the build has, and the framework's CUDA release and GPUs, on its last
# line, in one import where horovod's own probes import the framework again for each question.
_PROBE = """
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.stdout, out = open(os.devnull, "w"), sys.stdout
import horovod.{0} as hvd
{1}
out.write("\\n" + json.dumps({{"gloo": bool(hvd.gloo_built()), "nccl": int(hvd.nccl_built()),
                               "cuda": bool(hvd.cuda_built()), "framework_cuda": cuda,
                               "gpus": gpus}}))
"""
_DEVICES = {
    "torch": "import torch\ncuda, gpus = torch.version.cuda, torch.cuda.device_count()",
    "tensorflow": "import tensorflow as tf\n"
    "cuda = tf.sysconfig.get_build_info().get('cuda_version')\n"
    "gpus = len(tf.config.list_physical_devices('GPU'))",
}
_NAMES = {"torch": "PyTorch", "tensorflow": "TensorFlow"}


@functools.cache
def _probe(framework: str) -> dict:
    """What horovod's ``framework`` extension was built with (``gloo``, ``nccl``, ``cuda``),
    or ``{"error": why}`` where it does not load: the framework is not installed, horovod
    was built without it, or loading it failed (the last line it wrote)."""
    if importlib.util.find_spec(framework) is None:
        return {"error": f"{framework} is not installed"}
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _PROBE.format(framework, _DEVICES.get(framework, "cuda, gpus = None, 0")),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"importing horovod.{framework} took more than 300 s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return {"error": f"importing horovod.{framework} failed: {last}"}
    return json.loads(done.stdout.splitlines()[-1])


def horovod_nccl_built() -> int:
    """NCCL_VERSION_CODE of horovod's NCCL, or 0."""
    return max(_probe(f).get("nccl", 0) for f in ("torch", "tensorflow"))


def horovod_cuda_built() -> bool:
    """Whether a framework extension of horovod was compiled with CUDA (horovod's public
    ``gpu_available`` asks whether a GPU is there now, which a build machine lacks)."""
    return any(_probe(f).get("cuda", False) for f in ("torch", "tensorflow"))


def _cuda_versions(framework: str) -> str:
    """The CUDA release ``framework`` was built for, and the GPUs it sees here."""
    built = _probe(framework)
    return (
        f"{_NAMES[framework]}'s CUDA {built.get('framework_cuda')}, "
        f"{built.get('gpus', 0)} GPU(s) visible here"
    )


def _full_check(require_fix: bool, gpu: str | None = None) -> int:
    """``gpu``: the GPU line's framework (``torch`` or ``tensorflow``), or None on the CPU
    lines, where TensorFlow is required."""
    framework = _NAMES[gpu or "tensorflow"]
    built = _probe(gpu or "tensorflow")
    hint = GPU_HINTS[gpu] if gpu else install_hint(torch_installed())
    if "error" in built:
        print(f"horovod_ray: horovod lacks {framework} ({built['error']}); {hint}", file=sys.stderr)
        return 1
    if not built["gloo"]:
        print(f"horovod_ray: horovod lacks Gloo; {hint}", file=sys.stderr)
        return 1
    require_gloo()  # the executor's cheap check must agree
    print(f"horovod_ray: horovod has Gloo and {framework}")
    try:
        version = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:  # on a path without its metadata
        version = "(version unknown)"
    patched = gloo_iface_fixed() or exchange_allreduce() or core_counters()
    said = build_line(version, patched)
    print(said, file=sys.stdout if patched else sys.stderr)
    if _gpu_check(gpu):
        return 1
    if importlib.util.find_spec("torch") is None:
        print("horovod_ray: PyTorch is not installed (horovod.torch needs it and a rebuild)")
    elif "error" not in _probe("torch"):
        print("horovod_ray: horovod has PyTorch (horovod.torch)")
        if sync_batch_norm_on_cpu():
            print("horovod_ray: horovod has SyncBatchNorm on CPUs (horovod.torch)")
        else:
            print("horovod_ray: horovod's SyncBatchNorm is GPU-only, as released")
        if torch_waits_without_spinning():
            print("horovod_ray: horovod.torch waits for collectives without spinning")
        else:
            print(
                "horovod_ray: horovod.torch spins while it waits for a collective, as "
                "released (slower on few cores; `make install` builds it with the fix)"
            )
        if torch_wait_starts_the_cycle():
            print("horovod_ray: horovod.torch starts a cycle when a caller waits on it")
        else:
            print(
                "horovod_ray: horovod.torch's collectives wait for the next cycle, as "
                "released (slower on small models; `make install` builds it with the fix)"
            )
    else:
        print(
            "horovod_ray: PyTorch is installed but horovod lacks its extension, so "
            f"horovod.torch fails; {TORCH_HINT}",
            file=sys.stderr,
        )
        return 1
    if batched_rendezvous():
        print("horovod_ray: horovod has the batched rendezvous (a few requests per rank)")
    else:
        print("horovod_ray: horovod sends Gloo's per-key rendezvous (slow past ~100 ranks)")
    if exchange_allreduce():
        print("horovod_ray: horovod's Gloo allreduce sends small buffers in one message")
    else:
        print(
            "horovod_ray: horovod's Gloo allreduce splits even small buffers into Gloo's "
            "ring segments, as released (slower on small tensors; `make install` builds "
            "it with the fix)"
        )
    if reducescatter_waits_for_its_sends():
        print("horovod_ray: horovod's Gloo reducescatter waits for its sends")
    else:
        print(
            "horovod_ray: horovod's Gloo reducescatter returns before its sends are written, "
            "as released: its results can be wrong on a rank count that is not a power of "
            "two; `make install` in a horovod_ray checkout builds horovod with the fix",
            file=sys.stderr,
        )
        if require_fix:
            return 1
    if gloo_loop_waits_for_busy_pairs():
        print("horovod_ray: horovod's Gloo waits for a busy connection without spinning")
    else:
        print(
            "horovod_ray: horovod's Gloo spins while a send holds a connection, as "
            "released (slower on few cores; `make install` builds it with the fix)"
        )
    if core_counters():
        print("horovod_ray: horovod counts its collectives and the ranks it waited for")
    else:
        print(
            "horovod_ray: horovod keeps no counters of its collectives, as released (the "
            "jobs' metrics lack them and the straggler; `make install` builds it with them)"
        )
    port = keras3_port()
    if port:
        print("horovod_ray: horovod has the Keras 3 port (horovod.tensorflow.keras on Keras 3)")
    elif port is False:
        print(
            "horovod_ray: horovod lacks the Keras 3 port: horovod.tensorflow.keras, "
            "broadcast_variables and DistributedGradientTape fail on Keras 3 models; "
            "`make install` in a horovod_ray checkout builds horovod with the port",
            file=sys.stderr,
        )
        if require_fix:
            return 1
    if gloo_iface_fixed():
        print("horovod_ray: horovod has the Gloo interface fix (collectives use the chosen NIC)")
    else:
        print(
            "horovod_ray: horovod lacks the Gloo interface fix: a job across hosts needs each "
            "host's name to resolve to a routable address (not 127.0.1.1); `make install` in "
            "a horovod_ray checkout builds horovod with the fix",
            file=sys.stderr if require_fix else sys.stdout,
        )
        return 1 if require_fix else 0
    return 0


def build_line(version: str, patched: bool) -> str:
    """What the check says of the installed horovod's build. Pure.

    Args:
        version: horovod's version, as pip installed it.
        patched: Whether the build has this package's fixes (the probes found them).
    """
    if patched and is_patched(version):
        return f"horovod_ray: horovod {version}, built with horovod_ray's patches (a wheelhouse's)"
    if patched:
        return f"horovod_ray: horovod {version}, built with horovod_ray's patches (make install)"
    return (
        f"horovod_ray: horovod {version} is a stock build, without horovod_ray's patches "
        "(patches/: Keras 3, the Gloo interface fix, speed, counters): install the patched "
        "build from a wheelhouse (`pip install --no-index --find-links WHEELHOUSE "
        "--force-reinstall --no-deps horovod`; `make wheels` in a horovod_ray checkout makes "
        "one, docs/deploying.rst), or run `make install` in a checkout"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod_ray.stack.check_install")
    parser.add_argument(
        "--require-fix", action="store_true", help="fail where a fix of patches/ is missing"
    )
    parser.add_argument(
        "--gpu", choices=sorted(_NAMES), help="a GPU line: this framework, NCCL and CUDA required"
    )
    args = parser.parse_args(argv)
    return _full_check(require_fix=args.require_fix, gpu=args.gpu)


if __name__ == "__main__":
    sys.exit(main())
