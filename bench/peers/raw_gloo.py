"""Raw Gloo: the C++ ring allreduce of ``bench/peers/gloo_allreduce.cc``, no Horovod.

The floor that B1 and B6 compare horovod_ray's allreduce against, and the sweep's
reference. Built with CMake into ``build/gloo_allreduce`` on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.harness.common import ROOT

GLOO_BINARY = ROOT / "build" / "gloo_allreduce"


def ensure_gloo_binary(may_install: bool) -> bool:
    """Builds the raw Gloo benchmark (installing libgloo-dev when missing and allowed)."""
    if GLOO_BINARY.exists():
        return True
    headers = Path("/usr/include/gloo/allreduce_ring.h").exists()
    if not headers and not (may_install and shutil.which("apt-get")):
        print("  raw Gloo skipped: libgloo-dev is not installed (make bench installs it)")
        return False
    if not headers:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libgloo-dev"], env=env, check=False)
    build = ROOT / "build"
    for step in (
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build), "-j2"],
    ):
        if subprocess.run(step, capture_output=True, text=True).returncode != 0:
            print(f"  could not build the raw Gloo benchmark: {' '.join(step)}", flush=True)
            return False
    return GLOO_BINARY.exists()


def raw_gloo_seconds(nbytes: int, iters: int, warmup: int, hosts: tuple = ()) -> float:
    """Seconds of the C++ ring on 2 ranks: on loopback, or one on each of two ``hosts``."""
    with tempfile.TemporaryDirectory() as store:
        procs = [
            subprocess.Popen(
                _on_host(hosts, rank)
                + [
                    str(GLOO_BINARY),
                    "--rank",
                    str(rank),
                    "--size",
                    "2",
                    "--store",
                    store,
                    "--bytes",
                    str(nbytes),
                    "--iters",
                    str(iters),
                    "--warmup",
                    str(warmup),
                    "--host",
                    hosts[rank].address if hosts else "127.0.0.1",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (1, 0)
        ]
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    return json.loads(outputs[1])["seconds"]


def _on_host(hosts: tuple, rank: int) -> list[str]:
    """The prefix that runs a command on rank's simulated host (none on this machine)."""
    if not hosts:
        return []
    return hosts[rank].command([])
