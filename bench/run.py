"""Side-by-side benchmarks: horovod_ray against what a user would otherwise pick.

    python -m bench.run --mode full    # make bench: 5 alternating repetitions (2 for some)
    python -m bench.run --mode quick   # make bench-quick: one repetition, fewer points
    python -m bench.run --mode smoke   # make test-bench: smallest sizes, one repetition

Every comparison runs in this one invocation, alternating the systems within each
repetition (A, B, C, then B, C, A, ...), so that drift on a shared machine hits all of them.
Reports the median and min-max of each figure and the median of the pairwise ratios;
writes bench/results/latest.json and PNG plots there. What each figure means:
docs/benchmarks.rst.

This module is the command line only. The benchmarks are in ``bench.cases``: ``b1`` (B1
and the sweep), ``b2`` to ``b6`` (B6 elastic with B6), ``scripts`` (B7 and B8), ``b9``
(restarts and hangs; B12, a restart that resumes, against Ray Train v2, in ``resume``),
``ingest`` (B13, Ray Data into the ranks, against Ray Train v2's ``datasets=``), ``cloud``
(B10, a node drained against one lost, with Ray Train v2's answer in
``bench.peers.train_drain``; B11, the autoscaler) and ``scale``; what they share is in
``bench.harness.common``; the table and the plots in ``bench.harness.report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.cases import b1, b2, b3, b4, b5, b6, b9, cloud, scale, scripts
from bench.harness import report
from bench.harness.common import MODES, NUM_CPUS, RESULTS, Mode, in_own_process
from horovod_ray import local_ray

# What a pass runs unless --only says otherwise; "sweep", "scale" and "scale_start" only
# when named.
DEFAULT_PARTS = tuple(
    "b1 b2 b3 b4 b5 b6 b6e drain train_drain autoscaler b7 b8 b9 resume ingest bt".split()
)


def _sweep_point(text: str) -> tuple[int, int]:
    """``--sweep-point MB:RANKS`` as (bytes, ranks)."""
    megabytes, _, ranks = text.partition(":")
    if not (megabytes.isdigit() and ranks.isdigit() and int(megabytes) > 0 and int(ranks) > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give MB:RANKS, e.g. 64:2 (2 ranks or more)")
    return int(megabytes) << 20, int(ranks)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_PARTS),
        help="comma-separated subset",
    )
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument(
        "--sweep-point",
        action="append",
        type=_sweep_point,
        metavar="MB:RANKS",
        help="with --only sweep: this point only (repeatable); default: all of SWEEP_POINTS",
    )
    return parser


@dataclasses.dataclass
class _Parts:
    """The selected benchmarks' figures, merged into ``results`` as each one finishes.

    Attributes:
        only: The names selected with ``--only``.
        results: Every figure so far, written as the JSON results.
        seconds: How long each part that ran took.
    """

    only: set[str]
    results: dict
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def run(self, name: str, measure: Callable[..., dict], *args: object) -> None:
        """``measure(*args)`` if ``name`` (or one of the names that ``+`` joins) is selected."""
        if not set(name.split("+")) & self.only:
            return
        part_started = time.perf_counter()
        self.results.update(measure(*args))
        self.seconds[name] = time.perf_counter() - part_started
        print(f"{name}: {self.seconds[name]:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mode = MODES[args.mode]
    only = set(args.only.split(","))
    sweep_points = tuple(args.sweep_point or b1.SWEEP_POINTS)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    results: dict = {
        "mode": args.mode,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    parts = _Parts(only, results)
    started = time.perf_counter()
    may_install = args.mode != "smoke"
    _on_local_ray(parts, mode, may_install, sweep_points)
    _on_their_own_ray(parts, mode, may_install)
    parts.run("bt", in_own_process, "bench.cases.bt", args.mode)  # PyTorch's peers
    parts.run("train_drain", in_own_process, "bench.peers.train_drain", args.mode)  # B10's Train v2
    parts.run("resume", in_own_process, "bench.cases.resume", args.mode)  # B12, against Train v2
    parts.run("ingest", in_own_process, "bench.cases.ingest", args.mode)  # B13, Ray Data
    results["parts_s"] = parts.seconds
    results["wall_s"] = time.perf_counter() - started
    _write(results, out_path)
    return 0


def _on_local_ray(
    parts: _Parts, mode: Mode, may_install: bool, sweep_points: tuple[tuple[int, int], ...]
) -> None:
    """The benchmarks that share one local Ray of ``NUM_CPUS`` CPUs, started here."""
    local_ray.start(num_cpus=NUM_CPUS, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        parts.run("b3", b3.b3, mode)
        parts.run("b1", b1.b1, mode, may_install)
        parts.run("b2", b2.b2, mode)
        parts.run("b4", b4.b4, mode, storage)
        parts.run("sweep", b1.sweep, mode, may_install, sweep_points)
        parts.run("b9", b9.b9, mode)
    local_ray.stop()


def _on_their_own_ray(parts: _Parts, mode: Mode, may_install: bool) -> None:
    """The benchmarks that start their own Ray (simulated nodes or hosts, whole scripts)."""
    parts.run("b5", b5.b5, mode)
    parts.run("b6e", b6.b6_elastic, mode)
    parts.run("drain", cloud.drain, mode)
    parts.run("autoscaler", cloud.autoscaler, mode)
    parts.run("b7+b8", scripts.scripts, mode, "b7" in parts.only, "b8" in parts.only)
    # After the shutdown: the local Ray would otherwise idle beside the two hosts.
    parts.run("b6", b6.b6, mode, may_install)
    parts.run("scale", scale.measure, mode.scale_reps, mode.scale_deadline_s, mode.scale_sizes)
    parts.run("scale_start", scale.start_path, mode.scale_start_sizes, mode.scale_reps)


def _write(results: dict, out_path: Path) -> None:
    """Plots beside ``out_path``, the JSON results there, then the table."""
    results["plots"] = report.plot(results, out_path.parent)
    if "scale_by_way" in results:
        results["plots"].append(scale.plot(results, out_path.parent))
    out_path.write_text(json.dumps(results, indent=2))
    report.print_table(results)
    print(f"\nwrote {out_path} and {len(results['plots'])} plot(s) in {results['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
