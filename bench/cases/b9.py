"""B9: a failed static job's restart, and a hang's detection.

Restart: 2 ranks step every 50 ms, checkpointing; in the first attempt rank 1 dies at step
20. ``run(max_restarts=1)`` against what a user does by hand (``run()`` raises, they call
it again): seconds from the death to the first step of the new job. Ours includes the
1 s back-off before a restart. Hang: ``stall_timeout_s`` set, rank 1 stops before a
collective rank 0 waits in: seconds from then until ``HangError`` reaches the caller.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.cases import workloads
from bench.cases.b6 import _first_step
from bench.harness.common import Mode, alternate, ratio, summary

DIE_AT = 20
PAUSE_S = 0.05
HANG_TIMEOUT_S = 4


def b9(mode: Mode) -> dict:
    print("B9 restart after a rank dies; hang detection", flush=True)
    runs = alternate({"run(max_restarts=1)": _restarted, "by hand": _by_hand}, mode.b9_reps)
    hangs = [_hang_detected() for _ in range(mode.b9_reps)]
    return {
        "b9_restart_s": {name: summary(values) for name, values in runs.items()},
        "restart_s": summary(runs["run(max_restarts=1)"]),
        "restart_ratio_vs_manual": ratio(runs["run(max_restarts=1)"], runs["by hand"]),
        "hang_detect_s": summary(hangs),
        "b9_hang_timeout_s": HANG_TIMEOUT_S,
    }


def _in_folder(measure: Callable[[Path], float]) -> float:
    with tempfile.TemporaryDirectory() as folder:
        return measure(Path(folder))


def _restarted() -> float:
    import horovod_ray

    def measure(folder: Path) -> float:
        horovod_ray.run(
            workloads.dies_once, args=(str(folder), PAUSE_S, DIE_AT), num_slots=2,
            max_restarts=1,
        )  # fmt: skip
        return _recovered(folder)

    return _in_folder(measure)


def _by_hand() -> float:
    import horovod_ray
    from horovod_ray import WorkerFailedError

    def measure(folder: Path) -> float:
        args = (str(folder), PAUSE_S, DIE_AT)
        try:
            horovod_ray.run(workloads.dies_once, args=args, num_slots=2)
        except WorkerFailedError:
            horovod_ray.run(workloads.dies_once, args=args, num_slots=2)
        else:
            raise RuntimeError("the job did not fail when its rank died")
        return _recovered(folder)

    return _in_folder(measure)


def _recovered(folder: Path) -> float:
    died = float((folder / "died").read_text())
    return _first_step(folder, 2, died, timeout_s=5) - died


def _hang_detected() -> float:
    import horovod_ray
    from horovod_ray import HangError

    def measure(folder: Path) -> float:
        try:
            horovod_ray.run(
                workloads.stalls, args=(str(folder),), num_slots=2, stall_timeout_s=HANG_TIMEOUT_S
            )
        except HangError:
            raised_at = time.time()
        else:
            raise RuntimeError("the stalled job did not fail")
        return raised_at - float((folder / "stalled").read_text())

    return _in_folder(measure)
