"""B7 and B8: whole scripts from a fresh process, against ``horovodrun`` of the same work.

B7: ``workloads.py b2`` under ``horovod-ray run -np 2``, starting its own local Ray or
joining one that already runs (started here, as a user's cluster would be). B8:
``b8_script.py``, a script that calls ``horovod_ray.run`` and so starts the local Ray
itself, split into its parts (``b8_parts_s``): the interpreter's start and the imports,
``ray.init``, the job (``run()`` less its ``ray.init``), and the exit after ``run()``
returned (Ray's exit hook, then the interpreter's). The runs that start their own Ray
share one rotation and one set of ``horovodrun`` runs.
"""

from __future__ import annotations

import functools
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench.harness.common import NUM_CPUS, ROOT, Mode, alternate, ratio, summary, wait_for_quiet
from horovod_ray import local_ray

_SCRIPT = [sys.executable, str(ROOT / "bench" / "cases" / "workloads.py"), "b2"]
_CLI = [sys.executable, "-m", "horovod_ray", "run", "-np", "2"]
_HOROVODRUN = [
    str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np", "2",
    "-H", "localhost:2", *_SCRIPT,
]  # fmt: skip
_BOTH_RANKS = r"(?s)<stdout>:\{.*<stdout>:\{"  # each rank printed its figures


def scripts(mode: Mode, with_b7: bool, with_b8: bool) -> dict:
    """B7 and B8 (see the module's docstring); ``with_b7``, ``with_b8``: which of them."""
    print("B7/B8 scripts: one allreduce on 2 ranks from a fresh process", flush=True)
    parts: dict[str, list[float]] = {part: [] for part in B8_PARTS}
    systems: dict[str, Callable[[], float]] = {"horovodrun": _horovodrun_s}
    if with_b7:
        systems["horovod-ray local"] = lambda: _timed(_CLI + _SCRIPT, _BOTH_RANKS)[0]
    if with_b8:
        systems["horovod_ray"] = functools.partial(_b8_script, parts)
    local = alternate(systems, mode.script_reps)
    out: dict = {}
    if with_b8:
        out.update(_b8_figures(local, parts))
    if with_b7:
        out.update(_b7_figures(local, _joining(mode)))
    return out


def _timed(command: list[str], prints: str) -> tuple[float, str, float, float]:
    """Seconds of ``command`` once the last run's processes are gone, its stdout, and
    the wall-clock times it was started and had ended.

    Raises:
        RuntimeError: it failed, or its stdout does not match ``prints``.
    """
    wait_for_quiet()
    started_at, start = time.time(), time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    seconds, ended_at = time.perf_counter() - start, time.time()
    if out.returncode != 0 or not re.search(prints, out.stdout):
        raise RuntimeError(f"{command[:6]} failed: {out.stderr[-2000:]}")
    return seconds, out.stdout, started_at, ended_at


def _horovodrun_s() -> float:
    return _timed(_HOROVODRUN, _BOTH_RANKS)[0]


# B8's parts, in the order they happen (see the module's docstring).
B8_PARTS = ("start and imports", "ray.init", "job", "exit")


def _b8_script(parts: dict[str, list[float]]) -> float:
    """Seconds of ``b8_script.py 2``; each of its parts is added to ``parts``."""
    command = [sys.executable, str(ROOT / "bench" / "cases" / "b8_script.py"), "2"]
    seconds, stdout, started_at, ended_at = _timed(command, r"ranks 2 ray_start_s ")
    # Searched for: Ray may relay a worker's line after the script's own last one.
    found = re.search(r"ray_start_s (\S+) imported_at (\S+) returned_at (\S+)", stdout)
    ray_start_s, imported_at, returned_at = (float(value) for value in found.groups())
    split = (
        imported_at - started_at,
        ray_start_s,
        returned_at - imported_at - ray_start_s,
        ended_at - returned_at,
    )
    for part, value in zip(B8_PARTS, split, strict=True):
        parts[part].append(value)
    return seconds


def _b8_figures(local: dict[str, list[float]], parts: dict[str, list[float]]) -> dict:
    return {
        "b8_script_s": {name: summary(local[name]) for name in ("horovod_ray", "horovodrun")},
        "b8_ratio_vs_horovodrun": ratio(local["horovod_ray"], local["horovodrun"]),
        "b8_ray_start_s": summary(parts["ray.init"]),
        "b8_after_ray_start_s": statistics.median(
            a - b for a, b in zip(local["horovod_ray"], parts["ray.init"], strict=True)
        ),
        "b8_parts_s": {part: summary(values) for part, values in parts.items()},
    }


def _joining(mode: Mode) -> dict[str, list[float]]:
    """B7 joining: ``horovod-ray run --address`` of a local Ray started here, in a rotation
    with ``horovodrun``."""
    # Imported here, not above: bench.harness.common sets Ray's environment before ray is imported.
    import ray

    local_ray.start(num_cpus=NUM_CPUS, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        return alternate(
            {
                "horovodrun": _horovodrun_s,
                "horovod-ray joining": lambda: _timed(
                    [*_CLI, "--address", address, *_SCRIPT], _BOTH_RANKS
                )[0],
            },
            mode.script_reps,
        )
    finally:
        local_ray.stop()


def _b7_figures(local: dict[str, list[float]], joining: dict[str, list[float]]) -> dict:
    runs = {
        "horovodrun": local["horovodrun"] + joining["horovodrun"],
        "horovod-ray local": local["horovod-ray local"],
        "horovod-ray joining": joining["horovod-ray joining"],
    }
    return {
        "b7_script_s": {name: summary(values) for name, values in runs.items()},
        "b7_ratio_vs_horovodrun": ratio(joining["horovod-ray joining"], joining["horovodrun"]),
        "b7_ratio_local_vs_horovodrun": ratio(local["horovod-ray local"], local["horovodrun"]),
    }
