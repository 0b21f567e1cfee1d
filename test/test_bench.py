"""One smoke pass of the benchmark runner (smallest sizes, one repetition), so it does not
rot. It checks only that every figure was produced: timings are never asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from test.conftest import ROOT

pytestmark = pytest.mark.timeout(900)


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) else []


def _smoke(tmp_path, *args: str, timeout_s: float) -> tuple[dict, str]:
    """The runner's figures and printout after ``--mode smoke`` with ``args``."""
    out = tmp_path / "latest.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--mode", "smoke", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_smoke_pass_produces_every_figure(tmp_path):
    """The default pass but BT, which the next test checks on its own."""
    from bench.run import DEFAULT_PARTS

    parts = ",".join(part for part in DEFAULT_PARTS if part != "bt")
    figures, printed = _smoke(tmp_path, "--only", parts, timeout_s=880)
    for key in (
        "b1_allreduce_mbps",
        "b1_ratio_vs_horovodrun",
        "b1_ratio_at_rays_niceness_vs_horovodrun",
        "b1_ratio_metrics_on_vs_off",
        "b2_cold_start_s",
        "b2_ratio_vs_horovod_ray",
        "b2_ratio_vs_horovod_trainer",
        "b3_ratio",
        "b3_horovod_ray_ratio",
        "b3_ratio_metrics_on_vs_off",
        "b4_ratio",
        "b5_cold_start_s",
        "b7_script_s",
        "b7_ratio_vs_horovodrun",
        "b6_recovery_s",
        "b2_floor_s",
        "b8_script_s",
        "b8_ratio_vs_horovodrun",
        "b8_ray_start_s",
        "b8_parts_s",
        "b6_ratio_vs_restart",
        "b6_grow_s",
        "b10_to_two_ranks_s",
        "b10_ratio_drained_vs_killed",
        "b10_train_v2_to_two_workers_s",
        "b11_to_max_workers_s",
        "b11_idle_nodes_gone_s",
        "restart_s",
        "restart_ratio_vs_manual",
        "hang_detect_s",
        "b12_resume_s",
        "b12_ratio_vs_train_v2",
        "b13_rows_per_s_2",
        "b13_ratio_vs_train_v2_2",
        "b13_ratio_vs_by_hand_2",
    ):
        numbers = _numbers(figures[key])
        assert numbers and all(math.isfinite(n) and n > 0 for n in numbers), key
    assert set(figures["b1_allreduce_mbps"]) >= {"horovod_ray", "horovodrun", "horovod.ray"}
    assert set(figures["b2_cold_start_s"]["2"]) == {
        "horovod_ray",
        "horovod.ray",
        "HorovodTrainer",
        "horovodrun",
    }
    assert set(figures["b7_script_s"]) == {"horovodrun", "horovod-ray local", "horovod-ray joining"}
    assert list(figures["b8_parts_s"]) == ["start and imports", "ray.init", "job", "exit"]
    assert figures["b10_steps_begun_twice"]["drained"] == 0  # left at a commit: no rollback
    assert set(figures["b12_steps_done_again"]) == {"horovod_ray", "Ray Train v2"}
    # B6 needs simulated hosts (root, ip netns); without them it says why.
    assert figures.get("b6_skipped") or _numbers(figures["b6_allreduce_mbps"]["horovod_ray"])
    for plot in figures["plots"]:
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "== results" in printed


def test_scale_smoke_pass_produces_its_figures(tmp_path):
    """``--only scale,scale_start``: the rendezvous harness at 16 and 64 simulated ranks
    (each way), and a real 4-rank job's start; figures, not timings, are checked."""
    figures, _ = _smoke(tmp_path, "--only", "scale,scale_start", timeout_s=600)
    assert set(figures["scale_rendezvous_s"]) == {"16", "64"}
    assert figures["scale_rendezvous_finished"] == {"16": True, "64": True}
    # Batched: three requests per rank (set, held get, closing DELETE) when no get had
    # to be asked again; O(N^2) bytes: 16x the megabytes at 4x the ranks (O(N^3): 64x).
    assert 3 * 64 <= figures["scale_requests"]["64"] <= 4 * 64
    assert 8 < figures["scale_mbytes"]["64"] / figures["scale_mbytes"]["16"] < 32
    for way in ("stock", "backlog"):
        assert _numbers(figures["scale_by_way"][way]["seconds"])
    steps = figures["scale_start_s"]["4"]
    assert set(steps) >= {"placement", "actors", "environment", "rendezvous", "first_collective"}
    assert all(math.isfinite(s) and s >= 0 for s in steps.values())
    assert (tmp_path / "scale_rendezvous.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pytorch_comparison_produces_every_figure(tmp_path):
    """BT (in the default pass): horovod.torch against torch.distributed and Ray Train's
    TorchTrainer, in a process of its own."""
    figures, _ = _smoke(tmp_path, "--only", "bt", timeout_s=600)
    peers = {
        "bt1_allreduce_mbps": "torch.distributed",
        "bt2_epoch_s": "TorchTrainer",
        "bt3_cold_start_s": "TorchTrainer",
        "bt4_steps_per_s": "DDP",
    }
    for key, peer in peers.items():
        ours = {
            "bt2_epoch_s": {"horovod_ray", "horovod_ray metrics off"},
            "bt4_steps_per_s": {"horovod_ray", "horovod_ray find_stragglers"},
        }.get(key, {"horovod_ray"})
        assert set(figures[key]) == ours | {peer}
        assert all(math.isfinite(n) and n > 0 for n in _numbers(figures[key])), key
    assert all(figures[f"bt{n}_ratio"] > 0 for n in (1, 2, 3, 4))
    assert figures["bt2_ratio_metrics_on_vs_off"] > 0
    assert figures["bt4_ratio_stragglers_on_vs_off"] > 0
    assert set(figures["bt1_by_size"]) == {"1 MB x2", "1 MB x4"}  # the smoke's one size
