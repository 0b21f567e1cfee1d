"""Checks that the installed horovod can run a Gloo job with TensorFlow.

``require_gloo()`` is the cheap check the executor makes before taking any Ray resource:
it looks inside horovod's TensorFlow extension for the Gloo controller without importing
TensorFlow. ``python -m horovod_ray._check_install`` is the full check ``make install``
runs, through horovod's own probes.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import mmap
import os

from horovod_ray.errors import HorovodRayError

INSTALL_HINT = (
    "reinstall horovod with Gloo: HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 "
    "HOROVOD_WITHOUT_MPI=1 pip install --no-cache-dir --no-build-isolation horovod==0.28.1 "
    "(or run `make install` in a horovod_ray checkout)"
)

# Only a build with HAVE_GLOO compiles horovod's Gloo controller into the extension.
_GLOO_MARKER = b"GlooController"


@functools.cache
def _gloo_problem() -> str | None:
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return "horovod is not installed"
    package_dir = list(spec.submodule_search_locations)[0]
    libs = glob.glob(os.path.join(package_dir, "tensorflow", "mpi_lib*.so"))
    if not libs:
        return "horovod was built without TensorFlow support"
    with open(libs[0], "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(_GLOO_MARKER) < 0:
            return "horovod was built without Gloo"
    return None


def require_gloo() -> None:
    """Raises HorovodRayError, naming the install command, unless horovod has Gloo + TF."""
    problem = _gloo_problem()
    if problem is not None:
        raise HorovodRayError(f"{problem}; {INSTALL_HINT}")
