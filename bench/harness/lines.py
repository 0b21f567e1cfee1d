"""B1, B2 and the demo's epoch time on the two TensorFlow lines, side by side.

``make bench-lines`` (it builds both environments first). Each repetition runs, on each
line in turn (the order alternating), ``python -m bench.run --mode quick --only b1,b2``
and the digits example's training on 2 ranks; the epoch time is the mean gap between
epoch reports after the first epoch, as they reach the driver. Prints medians with
min-max and the median of per-repetition ratios (2.21 over 2.15), and writes
``bench/results/lines.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
LINES = {"2.21": ROOT / ".venv", "2.15": ROOT / ".venv-tf2.15"}


def demo_epoch_s(epochs: int = 15) -> dict:
    """In this environment: the digits example's training on 2 ranks of a local Ray."""
    import cloudpickle
    import ray

    import horovod_ray

    sys.path.insert(0, str(ROOT / "examples"))
    import tensorflow2_digits

    # The ranks cannot import the example by name: its function travels by value.
    cloudpickle.register_pickle_by_value(tensorflow2_digits)
    train = tensorflow2_digits.train

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    arrivals: list[float] = []
    results = horovod_ray.run(
        train,
        kwargs={"epochs": epochs, "learning_rate": 0.001, "batch_size": 32},
        num_slots=2,
        callbacks=[lambda _: arrivals.append(time.perf_counter())],
    )
    ray.shutdown()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"epoch_s": statistics.mean(gaps), "accuracy": results[0]["test_accuracy"]}


def _in_line(line: str, args: list[str]) -> str:
    python = LINES[line] / "bin" / "python"
    done = subprocess.run(
        [str(python), *args], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    if done.returncode:
        raise RuntimeError(f"{line}: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _one(line: str, rep: int) -> dict:
    out = RESULTS / f"lines-{line}-{rep}.json"
    _in_line(line, ["-m", "bench.run", "--mode", "quick", "--only", "b1,b2", "--out", str(out)])
    bench = json.loads(out.read_text())
    demo = json.loads(
        _in_line(line, ["-m", "bench.harness.lines", "--demo"]).strip().splitlines()[-1]
    )
    return {
        "b1_mbps": bench["b1_allreduce_mbps"]["horovod_ray"]["median"],
        "b2_2_s": bench["b2_cold_start_s"]["2"]["horovod_ray"]["median"],
        "b2_2_floor_s": bench["b2_floor_s"]["2"]["median"],
        "b2_2_above_floor_s": bench["b2_overhead_above_floor_s"]["2"]["horovod_ray"],
        "demo_epoch_s": demo["epoch_s"],
        "demo_accuracy": demo["accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--demo", action="store_true", help="(internal) one demo, as JSON")
    args = parser.parse_args(argv)
    if args.demo:
        print(json.dumps(demo_epoch_s()))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {line: [] for line in LINES}
    for rep in range(args.reps):
        order = list(LINES) if rep % 2 == 0 else list(reversed(LINES))
        for line in order:
            runs[line].append(_one(line, rep))
            print(f"rep {rep + 1} TF {line}: {runs[line][-1]}", flush=True)
    table = {}
    for key in runs["2.21"][0]:
        new = [r[key] for r in runs["2.21"]]
        old = [r[key] for r in runs["2.15"]]
        table[key] = {
            "2.21": {"median": statistics.median(new), "min": min(new), "max": max(new)},
            "2.15": {"median": statistics.median(old), "min": min(old), "max": max(old)},
            "ratio": statistics.median(a / b for a, b in zip(new, old, strict=True)),
        }
        print(
            f"{key:20s} 2.21 {table[key]['2.21']['median']:.3f} "
            f"({min(new):.3f}-{max(new):.3f})  2.15 {table[key]['2.15']['median']:.3f} "
            f"({min(old):.3f}-{max(old):.3f})  ratio {table[key]['ratio']:.3f}"
        )
    (RESULTS / "lines.json").write_text(json.dumps({"runs": runs, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
