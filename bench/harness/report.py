"""The results of one run, for people: the table printed at the end and the PNG plots."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def print_table(results: dict) -> None:
    """Prints each benchmark's figures that ``results`` holds: medians, min - max, ratios."""
    print("\n== results (median, min - max) ==")
    _print_b1(results)
    _print_b2(results)
    _print_b3_b4_b5(results)
    _print_b6(results)
    _print_b8(results)
    _print_b7(results)
    _print_b9(results)
    _print_bt(results)


def _print_bt(results: dict) -> None:
    for point, systems in results.get("bt1_by_size", {}).items():
        print(f"BT1 allreduce {point}")
        for name, s in systems.items():
            if name != "ratio":
                print(_row(name, s, "MB/s"))
        print(f"  {'ratio vs torch.distributed':<32} {systems['ratio']:.3f}")
    for key, unit in (
        ("bt4_steps_per_s", "step/s"),
        ("bt2_epoch_s", "s"),
        ("bt3_cold_start_s", "s"),
    ):
        if key in results:
            print(f"{key.split('_')[0].upper()} {key}")
            for name, s in results[key].items():
                print(_row(name, s, unit))
            ratio_key = key.split("_")[0] + "_ratio"
            print(f"  {ratio_key:<32} {results[ratio_key]:.3f}")
            for cost in ("_metrics_on_vs_off", "_stragglers_on_vs_off"):
                if ratio_key + cost in results:
                    print(f"  {ratio_key + cost:<32} {results[ratio_key + cost]:.3f}")


def _print_b9(results: dict) -> None:
    if "b9_restart_s" in results:
        print("B9 from a rank's death to the new job's first step")
        for name, s in results["b9_restart_s"].items():
            print(_row(name, s, "s"))
        print(f"  {'restart_ratio_vs_manual':<32} {results['restart_ratio_vs_manual']:.3f}")
        timeout_s = results["b9_hang_timeout_s"]
        print(f"B9 hang detected, stall_timeout_s={timeout_s:g}")
        print(_row("hang_detect_s", results["hang_detect_s"], "s"))


def _row(name: str, s: dict, unit: str) -> str:
    spread = "(one run)" if len(s["runs"]) == 1 else f"({s['min']:.3f} - {s['max']:.3f})"
    return f"  {name:<18} {s['median']:10.3f} {unit:<5} {spread}"


def _print_b1(results: dict) -> None:
    if "b1_allreduce_mbps" in results:
        print("B1 allreduce throughput")
        for name, s in results["b1_allreduce_mbps"].items():
            print(_row(name, s, "MB/s"))
        for key in (
            "b1_ratio_vs_horovodrun",
            "b1_ratio_at_rays_niceness_vs_horovodrun",
            "b1_ratio_vs_raw_gloo",
            "b1_ratio_vs_horovod_ray",
            "b1_ratio_metrics_on_vs_off",
        ):
            if key in results:
                print(f"  {key:<32} {results[key]:.3f}")


def _print_b2(results: dict) -> None:
    for workers, systems in results.get("b2_cold_start_s", {}).items():
        print(f"B2 cold start, {workers} workers")
        for name, s in systems.items():
            print(_row(name, s, "s"))
        trainer = results["b2_ratio_vs_horovod_trainer"].get(workers)
        print(
            f"  ratio vs horovod.ray {results['b2_ratio_vs_horovod_ray'][workers]:.3f}"
            + (f"  vs HorovodTrainer {trainer:.3f}" if trainer is not None else "")
        )
        if workers in results.get("b2_floor_s", {}):
            above = results["b2_overhead_above_floor_s"][workers]
            print(
                f"  import floor {results['b2_floor_s'][workers]['median']:.3f} s; above it: "
                + ", ".join(f"{name} {value:+.3f} s" for name, value in above.items())
            )


def _print_b3_b4_b5(results: dict) -> None:
    if "b3_call_ms" in results:
        print("B3 no-op call, 4 workers")
        for name, s in results["b3_call_ms"].items():
            print(_row(name, s, "ms"))
        print(f"  b3_ratio {results['b3_ratio']:.3f}  b3_run_ratio {results['b3_run_ratio']:.3f}")
        for key in ("b3_horovod_ray_ratio", "b3_ratio_metrics_on_vs_off"):
            if key in results:
                print(f"  {key} {results[key]:.3f}")
    if "b4_tune_s" in results:
        print("B4 Tune turnaround")
        for name, s in results["b4_tune_s"].items():
            print(_row(name, s, "s"))
        print(f"  b4_ratio {results['b4_ratio']:.3f}")
    for point, s in results.get("b5_cold_start_s", {}).items():
        print(f"B5 {point:<6} {s['median']:.2f}s")


def _print_b6(results: dict) -> None:
    """B6 across hosts, the sweep, then B6 elastic: the order the table always had."""
    if "b6_allreduce_mbps" in results:
        print("B6 allreduce across two simulated hosts")
        for name, s in results["b6_allreduce_mbps"].items():
            print(_row(name, s, "MB/s"))
        if "b6_ratio_vs_raw_gloo" in results:
            print(f"  b6_ratio_vs_raw_gloo {results['b6_ratio_vs_raw_gloo']:.3f}")
    for point, systems in results.get("sweep_mbps", {}).items():
        ratios = systems["ratio_vs_defaults"]
        print(f"sweep {point}: " + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items()))
    if "b6_recovery_s" in results:
        print("B6 elastic recovery after a node loss (s)")
        for name, s in results["b6_recovery_s"].items():
            print(_row(name, s, "s"))
        print(_row("grow back", results["b6_grow_s"], "s"))
        print(f"  b6_ratio_vs_restart {results['b6_ratio_vs_restart']:.3f}")
    if "b10_to_two_ranks_s" in results:
        print("B10 from a node's drain (or loss) to the first step without it (s)")
        for name, s in results["b10_to_two_ranks_s"].items():
            print(_row(name, s, "s"))
        print(f"  b10_ratio_drained_vs_killed {results['b10_ratio_drained_vs_killed']:.3f}")
        print(f"  steps begun twice (most on a rank): {results['b10_steps_begun_twice']}")
    if "b10_train_v2_to_two_workers_s" in results:
        deadline = results["b10_train_v2_deadline_s"]
        print(f"B10 Ray Train v2, drained with a {deadline} s deadline")
        print(_row("to 2 workers", results["b10_train_v2_to_two_workers_s"], "s"))
        print(_row("steps done again", results["b10_train_v2_steps_done_again"], ""))
    if "b10_static_to_resumed_s" in results:
        deadline = results["b10_static_deadline_s"]
        print(f"B10 a static job checkpointing on the notice, drained with a {deadline} s deadline")
        print(_row("to the resumed job's first step", results["b10_static_to_resumed_s"], "s"))
        print(_row("steps done again", results["b10_static_steps_done_again"], ""))
        if "b10_train_v2_to_two_workers_s" in results:
            ours = results["b10_static_to_resumed_s"]["median"]
            theirs = results["b10_train_v2_to_two_workers_s"]["median"]
            print(f"  b10_ratio_static_vs_train_v2 {ours / theirs:.3f} (seconds to recover)")
    if "b12_resume_s" in results:
        print("B12 from a rank's death to the first step of the resumed job (s)")
        for name, s in results["b12_resume_s"].items():
            print(_row(name, s, "s"))
            print(_row("  steps done again", results["b12_steps_done_again"][name], ""))
        print(f"  b12_ratio_vs_train_v2 {results['b12_ratio_vs_train_v2']:.3f}")
    for ranks in (2, 4):
        if f"b13_rows_per_s_{ranks}" in results:
            rows = results["b13_rows"]
            print(f"B13 Ray Data into {ranks} ranks, {rows} rows x {results['b13_epochs']} epochs")
            for name, s in results[f"b13_rows_per_s_{ranks}"].items():
                print(_row(name, s, "row/s"))
            for against in ("train_v2", "by_hand"):
                key = f"b13_ratio_vs_{against}_{ranks}"
                print(f"  {key:<32} {results[key]:.3f}")
    if "b11_to_max_workers_s" in results:
        print("B11 an elastic job on the nodes the autoscaler launches for it (s)")
        print(_row("run() to 6 ranks", results["b11_to_max_workers_s"], "s"))
        print(_row("end to idle nodes gone", results["b11_idle_nodes_gone_s"], "s"))


def _print_b8(results: dict) -> None:
    if "b8_script_s" in results:
        print("B8 fresh script to result, 2 ranks")
        for name, s in results["b8_script_s"].items():
            print(_row(name, s, "s"))
        print("  horovod_ray's parts:")
        for part, s in results["b8_parts_s"].items():
            print(_row(f"  {part}", s, "s"))
        print(
            f"  b8_ratio_vs_horovodrun {results['b8_ratio_vs_horovodrun']:.3f}; after Ray's "
            f"start {results['b8_after_ray_start_s']:.3f} s"
        )


def _print_b7(results: dict) -> None:
    if "b7_script_s" in results:
        print("B7 script wall time, 2 ranks")
        for name, s in results["b7_script_s"].items():
            print(_row(name, s, "s"))
        print(
            f"  b7_ratio_vs_horovodrun (joining) {results['b7_ratio_vs_horovodrun']:.3f}"
            f"  local {results['b7_ratio_local_vs_horovodrun']:.3f}"
        )


def plot(results: dict, directory: Path) -> list[str]:
    """Writes a PNG per figure that ``results`` holds into ``directory``; their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def bars(title: str, data: dict, unit: str, name: str) -> None:
        written.append(_bars(plt, directory, title, data, unit, name))

    if "b1_allreduce_mbps" in results:
        bars("B1 allreduce, 2 workers", results["b1_allreduce_mbps"], "MB/s", "b1_allreduce.png")
    if "b6_allreduce_mbps" in results:
        title = "B6 allreduce across 2 simulated hosts"
        bars(title, results["b6_allreduce_mbps"], "MB/s", "b6_allreduce_hosts.png")
    for workers, systems in results.get("b2_cold_start_s", {}).items():
        bars(f"B2 cold start, {workers} workers", systems, "seconds", f"b2_cold_{workers}.png")
    if "b4_tune_s" in results:
        bars("B4 Tune turnaround", results["b4_tune_s"], "seconds", "b4_tune.png")
    if "b7_script_s" in results:
        bars("B7 script wall time, 2 ranks", results["b7_script_s"], "seconds", "b7_script.png")
    if results.get("b5_cold_start_s"):
        written.append(_b5_scaling(plt, results["b5_cold_start_s"], directory))
    return written


def _bars(plt: ModuleType, directory: Path, title: str, data: dict, unit: str, name: str) -> str:
    """A bar per system: its median, the whiskers its min and max; the file's name."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(data)
    medians = [data[k]["median"] for k in labels]
    errors = [
        [m - data[k]["min"] for k, m in zip(labels, medians, strict=True)],
        [data[k]["max"] - m for k, m in zip(labels, medians, strict=True)],
    ]
    ax.bar(labels, medians, yerr=errors, capsize=4, color="#4c72b0")
    ax.set_title(title)
    ax.set_ylabel(unit)
    fig.tight_layout()
    fig.savefig(directory / name, dpi=100)
    plt.close(fig)
    return name


def _b5_scaling(plt: ModuleType, points: dict, directory: Path) -> str:
    """B5's cold start against workers, a line per node count; the file's name."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    by_nodes: dict[int, list[tuple[int, float]]] = {}
    for s in points.values():
        by_nodes.setdefault(s["nodes"], []).append((s["workers"], s["median"]))
    for nodes, line in sorted(by_nodes.items()):
        line.sort()
        ax.plot([p[0] for p in line], [p[1] for p in line], marker="o", label=f"{nodes} node(s)")
    ax.set_xlabel("workers")
    ax.set_ylabel("cold start + first allreduce (s)")
    ax.set_title("B5 scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "b5_scaling.png", dpi=100)
    plt.close(fig)
    return "b5_scaling.png"
