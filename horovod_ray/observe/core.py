"""horovod's own counters in this process, read through its C API.

This package's horovod patch (patches/horovod-0.28.1-work-and-straggler-counters.patch)
adds two functions to each framework's extension: ``horovod_ray_core_stats`` (the
collectives' count, bytes and seconds, and how long hvd.init and its rendezvous took)
and ``horovod_ray_waited_for`` (rank 0's coordinator: seconds the job waited for each
rank as the last one ready for a collective). A stock horovod has neither: nothing is
read then.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from typing import Any

# The frameworks' extension modules, in the order they are looked for.
_MODULES = ("horovod.torch.mpi_ops", "horovod.tensorflow.mpi_ops")
STATS = 5


@dataclasses.dataclass(frozen=True)
class CoreStats:
    """horovod's counters in this process, since it started."""

    bytes: float
    seconds: float
    collectives: float
    init_s: float
    rendezvous_s: float


def library() -> Any:
    """The ctypes handle of the extension this process's horovod runs in (each framework
    has its own: the one imported that hvd.init() started, with the counters), or None."""
    for name in _MODULES:
        module = sys.modules.get(name)
        basics = getattr(module, "_basics", None)
        lib = getattr(basics, "MPI_LIB_CTYPES", None)
        if lib is not None and hasattr(lib, "horovod_ray_core_stats") and lib.horovod_size() > 0:
            lib.horovod_ray_core_stats.restype = ctypes.c_int
            lib.horovod_ray_waited_for.restype = ctypes.c_int
            return lib
    return None


def stats(lib: Any) -> CoreStats:
    values = (ctypes.c_double * STATS)()
    filled = lib.horovod_ray_core_stats(values, STATS)
    return CoreStats(*(values[i] if i < filled else 0.0 for i in range(STATS)))


def waited_for(lib: Any, size: int) -> list[tuple[float, int]]:
    """Per rank (index), the seconds the job waited for it alone and how many times;
    empty except on rank 0 once horovod negotiated a collective (``size`` is horovod's,
    -1 before hvd.init())."""
    if size <= 0:
        return []
    seconds = (ctypes.c_double * size)()
    counts = (ctypes.c_longlong * size)()
    known = lib.horovod_ray_waited_for(seconds, counts, size)
    return [(seconds[r], counts[r]) for r in range(min(known, size))]
