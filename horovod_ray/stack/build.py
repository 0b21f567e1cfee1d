"""Checks that the installed horovod can run a Gloo job.

``require_gloo()`` is the cheap check the executor makes before taking any Ray resource:
it looks inside one of horovod's framework extensions (TensorFlow's, else PyTorch's, as in
a PyTorch-only or the GPU line's build) for the Gloo controller without importing either
framework. ``python -m horovod_ray.stack.check_install`` is the full check ``make install``
runs, loading each framework's extension once in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import mmap
import os

from horovod_ray.errors import HorovodRayError


def torch_installed() -> bool:
    """Whether PyTorch is installed here (the default line; the 2023 line has none)."""
    return importlib.util.find_spec("torch") is not None


def install_hint(with_torch: bool) -> str:
    """How to reinstall horovod with Gloo on a CPU line: with PyTorch where PyTorch is
    installed (the default line's build, as ``make install`` does it), without it
    elsewhere (the 2023 line), so that the rebuild keeps ``horovod.torch`` where it can."""
    torch = "HOROVOD_WITH_PYTORCH=1" if with_torch else "HOROVOD_WITHOUT_PYTORCH=1"
    return (
        "reinstall horovod with Gloo: `make install` in a horovod_ray checkout, or, with "
        "the fixes in patches/ applied to its source as docs/install.rst shows, "
        f"HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 {torch} HOROVOD_WITHOUT_MPI=1 "
        "HOROVOD_WITHOUT_MXNET=1 pip install --no-build-isolation --no-cache-dir "
        "./horovod-0.28.1"
    )


# What builds each GPU line (docs/gpus.rst): each framework's CUDA build, with horovod's
# HOROVOD_GPU_OPERATIONS=NCCL, in an environment of its own.
GPU_HINTS = {
    "torch": "build the GPU line: `make install GPU=1` in a horovod_ray checkout (PyTorch's "
    "CUDA build, and horovod with HOROVOD_GPU_OPERATIONS=NCCL; docs/gpus.rst)",
    "tensorflow": "build the TensorFlow GPU line: `make install GPU=tf` in a horovod_ray "
    "checkout (TensorFlow's CUDA build, and horovod with HOROVOD_GPU_OPERATIONS=NCCL; "
    "docs/gpus.rst)",
}

TORCH_HINT = (
    "rebuild horovod with HOROVOD_WITH_PYTORCH=1 against the installed PyTorch "
    "(`make install` in a horovod_ray checkout does; docs/install.rst shows the commands)"
)

# Only a build with HAVE_GLOO compiles horovod's Gloo controller into the extension.
_GLOO_MARKER = b"GlooController"
# A string that only a horovod built with patches/horovod-*-gloo-process-set-iface.patch
# holds: its process-set Gloo context then uses HOROVOD_GLOO_IFACE like the global one.
_IFACE_FIX_MARKER = b"Gloo process set device interface"


def _horovod_dir() -> str | None:
    """The installed horovod package's folder, found without importing it."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


# Where each framework's extension lies in horovod's package; each holds horovod's common
# core (its controllers and the patched Gloo code), so any one answers the checks below.
_EXTENSIONS = (("tensorflow", "mpi_lib*.so"), ("torch", "mpi_lib_v2*.so"))


@functools.cache
def _extension() -> str | None:
    package_dir = _horovod_dir()
    if package_dir is None:
        return None
    for folder, pattern in _EXTENSIONS:
        libs = glob.glob(os.path.join(package_dir, folder, pattern))
        if libs:
            return libs[0]
    return None


def _extension_has(marker: bytes) -> bool:
    return _file_has(_extension(), marker)


def _torch_extension_has(marker: bytes) -> bool:
    """Whether horovod.torch's extension (not the first one found, as _extension_has
    reads) holds ``marker``."""
    package_dir = _horovod_dir()
    pattern = os.path.join(package_dir or "", "torch", dict(_EXTENSIONS)["torch"])
    libs = glob.glob(pattern) if package_dir else []
    return _file_has(libs[0] if libs else None, marker)


def _file_has(path: str | None, marker: bytes) -> bool:
    if path is None:
        return False
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(marker) >= 0


@functools.cache
def _gloo_problem() -> str | None:
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed"
    if _extension() is None:
        return "horovod was built without TensorFlow or PyTorch support"
    if not _extension_has(_GLOO_MARKER):
        return "horovod was built without Gloo"
    return None


@functools.cache
def gloo_iface_fixed() -> bool:
    """Whether horovod's collectives honour HOROVOD_GLOO_IFACE (this repo's patch).

    A stock horovod 0.28.1 uses the interface only for its first Gloo context; the one
    that carries every collective resolves the host's name instead (see docs/clusters.rst,
    "Host names that resolve to loopback").
    """
    return _gloo_problem() is None and _extension_has(_IFACE_FIX_MARKER)


@functools.cache
def batched_rendezvous() -> bool:
    """Whether horovod's ranks rendezvous in batched requests (this repo's patch); a
    stock horovod sends Gloo's per-key requests, which the server answers too, slower
    (see docs/clusters.rst, "Large jobs")."""
    return _gloo_problem() is None and _extension_has(b"HTTP multi_get_parts")


def installed_version(*names: str) -> str | None:
    """The version of the first of the distributions ``names`` that is installed (one
    package under the names of its builds: ``tensorflow-cpu`` or ``tensorflow``), or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def keras3_port() -> bool | None:
    """Whether horovod's Keras API is ported to Keras 3 (this repo's patches
    horovod-*-keras3-*.patch); None where the installed Keras is not 3 (the 2023 line),
    which stock horovod supports."""
    version = installed_version("keras")
    if version is None or int(version.split(".")[0]) < 3:
        return None
    package_dir = _horovod_dir()
    return package_dir is not None and os.path.exists(
        os.path.join(package_dir, "_keras", "keras3.py")
    )


def nccl_in_build() -> bool:
    """Whether horovod was compiled with NCCL (``HOROVOD_GPU_OPERATIONS=NCCL``, the GPU
    line): its extension then calls NCCL. Read from the library's bytes, without importing
    a framework, for the tests to choose what to run; ``make install``'s check asks the
    loaded extension (``check_install``), which also gives NCCL's version."""
    return _gloo_problem() is None and _extension_has(b"ncclCommInitRank")


def nccl_version(code: int) -> str:
    """NCCL_VERSION_CODE as horovod reports it (``hvd.nccl_built()``) to its release: from
    NCCL 2.9 on X*10000 + Y*100 + Z (2.30.7 is 23007), before that X*1000 + Y*100 + Z."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def sync_batch_norm_on_cpu() -> bool:
    """Whether ``horovod.torch.SyncBatchNorm`` runs on CPU tensors (this repo's patch
    horovod-*-torch-sync-batch-norm-cpu.patch); stock horovod's is GPU-only."""
    package_dir = _horovod_dir()
    if package_dir is None:
        return False
    path = os.path.join(package_dir, "torch", "sync_batch_norm.py")
    with contextlib.suppress(OSError), open(path) as source:
        return "def _batch_norm_stats(" in source.read()
    return False


def torch_waits_without_spinning() -> bool:
    """Whether ``horovod.torch``'s wait for a collective sleeps (this repo's patch
    horovod-*-torch-wait-without-spinning.patch); stock horovod's loops on poll and yield,
    taking a core from the threads that do the work (docs/benchmarks.rst)."""
    return _torch_extension_has(b"was cleared while it was waited on")


def torch_wait_starts_the_cycle() -> bool:
    """Whether a ``horovod.torch`` caller waiting on a collective starts horovod's next
    cycle at once, and keeps cycles at most 1 ms apart until it is done (this repo's patch
    horovod-*-torch-waiting-caller-starts-the-cycle.patch); stock horovod's background
    thread first sleeps out the cycle time (1 ms), most of a small model's step
    (docs/benchmarks.rst). The patch's first version woke the thread once, so a collective
    that a cycle had taken before every rank queued it waited out a whole cycle; its
    second counted a wait that raised (a handle cleared by a reset) as waiting for ever,
    so that cycles stayed 1 ms apart from then on."""
    return _torch_extension_has(b"horovod_ray_cycle_waiters")


def exchange_allreduce() -> bool:
    """Whether horovod's Gloo allreduce sends a small buffer in one message to each rank
    (this repo's patch horovod-*-gloo-exchange-allreduce.patch); stock horovod's uses
    Gloo's ring at every size, whose segments cost a millisecond or more on a few bytes
    (docs/benchmarks.rst)."""
    return _gloo_problem() is None and _extension_has(b"HOROVOD_GLOO_EXCHANGE_ALLREDUCE_BYTES")


def reducescatter_waits_for_its_sends() -> bool:
    """Whether Gloo's reducescatter returns only once its sends are written (this repo's
    patch horovod-*-gloo-reduce-scatter-waits-for-its-sends.patch); the Gloo in horovod's
    release returns while one may still read the buffer that it and horovod then write,
    which gave wrong results on 3 ranks (docs/troubleshooting.rst)."""
    return _gloo_problem() is None and _extension_has(b"waitForSends")


def gloo_loop_waits_for_busy_pairs() -> bool:
    """Whether Gloo's I/O thread waits for a connection that another thread holds (this
    repo's patch horovod-*-gloo-loop-waits-for-a-busy-pair.patch); the Gloo in horovod's
    release spins on it meanwhile, for as long as a send holds it, taking the CPU from
    the threads that do the work (docs/benchmarks.rst)."""
    return _gloo_problem() is None and (
        _extension_has(b"pthread_mutex_clocklock") or _extension_has(b"pthread_mutex_timedlock")
    )


def core_counters() -> bool:
    """Whether horovod counts its collectives and which rank the others waited for (this
    repo's patch horovod-*-work-and-straggler-counters.patch), which the ranks' metrics
    read (docs/observability.rst); stock horovod keeps neither."""
    return _extension_has(b"horovod_ray_waited_for")


def require_gloo() -> None:
    """Raises HorovodRayError, naming the install command, unless horovod has Gloo and a
    framework extension."""
    problem = _gloo_problem()
    if problem is not None:
        raise HorovodRayError(f"{problem}; {install_hint(torch_installed())}")
