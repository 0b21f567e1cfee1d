"""A real 2-rank job's metrics, scraped by a real Prometheus (Debian's) from Ray's
metrics ports: every metric of the catalog with its labels and plausible values, the
straggler named by rank, every panel of the Grafana dashboard returning data,
``horovod-ray status`` and ``horovod_ray.jobs()`` listing the job, and horovod's
timeline brought to the driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

import horovod_ray
from horovod_ray import RayExecutor
from horovod_ray.observe.catalog import CATALOG, RANK
from test.conftest import ROOT, start_local_ray
from test.observe.prometheus import Prometheus, value

STEPS = 25
# Rank 1 sleeps this long before each step's allreduce: the straggler.
SLEEP_S = 0.2
CHECKPOINT_EVERY = 10
CHECKPOINT_BYTES = 100_000
ELEMENTS = 1 << 16  # float32: 256 KiB per allreduce
TENSORS = 3  # per step, as a step's gradients: the straggler is charged once a step
PAUSE_S = 4  # after the steps, inside the call, with no collective: a stall
BATCH = 4  # rows of the job's dataset a rank takes per step


def train():
    import os
    import tempfile
    import time

    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint

    import horovod_ray

    hvd.init()
    tensors = [torch.ones(ELEMENTS) for _ in range(TENSORS)]
    batches = iter(horovod_ray.get_dataset_shard("train").iter_batches(batch_size=BATCH))
    for step in range(STEPS):
        next(batches)  # a step's data: counted as the rank's wait for it
        if hvd.rank() == 1:
            time.sleep(SLEEP_S)
        handles = [hvd.allreduce_async_(t, name=f"gradient{i}") for i, t in enumerate(tensors)]
        for handle in handles:
            hvd.synchronize(handle)
        checkpoint = None
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            folder = tempfile.mkdtemp()
            with open(os.path.join(folder, "model"), "wb") as model:
                model.write(os.urandom(CHECKPOINT_BYTES))
            checkpoint = Checkpoint.from_directory(folder)
        horovod_ray.report({"step": step, "loss": 1.0 / (step + 1)}, checkpoint=checkpoint)
    time.sleep(PAUSE_S)
    return hvd.rank()


def _panel_queries() -> list[tuple[str, str]]:
    with open(ROOT / "dashboards" / "horovod_ray.json") as handle:
        dashboard = json.load(handle)
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Runs the job, then collects what Prometheus, the GCS and the driver hold."""
    folder = tmp_path_factory.mktemp("observed")
    start_local_ray(4, metrics=True)
    session = ray._private.worker._global_node.get_session_dir_path()
    prometheus = Prometheus(os.path.join(session, "prom_metrics_service_discovery.json"))
    seen: dict = {"timeline": folder / "timeline.json"}
    try:
        settings = RayExecutor.create_settings(
            storage_path=str(folder / "runs"),
            name="observed",
            report_values=True,
            find_stragglers=True,
            timeline=str(seen["timeline"]),
        )
        dataset = ray.data.range(2 * STEPS * BATCH)
        executor = RayExecutor(settings, num_workers=2, datasets={"train": dataset})
        executor.start()
        try:
            job_id = seen["job_id"] = executor.job_id
            assert executor.run(train) == [0, 1]
            # The ranks' metrics that move last: once they show, the others have.
            for name, rank, least in (
                ("reports_total", 0, STEPS),
                ("collectives_total", 0, STEPS),
                ("checkpoint_uploads_total", 0, STEPS // CHECKPOINT_EVERY),
                ("waited_for_total", 1, STEPS * 0.8),  # rank 1 was waited for
            ):
                prometheus.wait_for(
                    f'ray_horovod_ray_{name}{{job_id="{job_id}",rank="{rank}"}}',
                    lambda series, least=least: bool(series) and value(series[0]) >= least,
                )
            prometheus.wait_for(  # the call ended: no stall
                f'max(ray_horovod_ray_stall_seconds{{job_id="{job_id}"}})',
                lambda series: bool(series) and value(series[0]) == 0,
            )
            seen["stall_peak"] = prometheus.query(
                f'max_over_time(ray_horovod_ray_stall_seconds{{job_id="{job_id}"}}[5m])'
            )
            seen["series"] = {
                metric.name: prometheus.query(f'ray_{metric.name}{{job_id="{job_id}"}}')
                for metric in CATALOG
            }
            seen["panels"] = [
                (
                    title,
                    expr,
                    prometheus.query(
                        expr.replace("$job_id", job_id).replace("$__rate_interval", "1m")
                    ),
                )
                for title, expr in _panel_queries()
            ]
            seen["jobs"] = horovod_ray.jobs()
            seen["status"] = subprocess.run(
                [sys.executable, "-m", "horovod_ray", "status", "--json",
                 "--address", ray.get_runtime_context().gcs_address],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            seen["node"] = ray.util.get_node_ip_address()
        finally:
            executor.stop()
        seen["stopped"] = prometheus.wait_for(
            f'ray_horovod_ray_job_state{{job_id="{job_id}",state="stopped"}}',
            lambda series: bool(series) and value(series[0]) == 1,
        )
        seen["ended"] = horovod_ray.jobs(all=True)
        seen["running_after"] = horovod_ray.jobs()
    finally:
        prometheus.stop()
    return seen


@pytest.mark.parametrize("metric", CATALOG, ids=lambda metric: metric.name)
def test_every_metric_of_the_catalog_has_series_with_its_labels(observed, metric):
    series = observed["series"][metric.name]
    assert series, f"no series of ray_{metric.name}"
    for each in series:
        labels = each["metric"]
        assert labels["job_name"] == "observed"
        assert labels["job_id"] == observed["job_id"]
        assert set(metric.labels) <= set(labels), (metric.labels, labels)
        if set(RANK) <= set(metric.labels):
            assert labels["rank"] in ("0", "1")
            assert labels["node"] == observed["node"]


def _by(observed, name: str, label: str) -> dict[str, float]:
    series = observed[name] if name in observed else observed["series"][name]
    return {s["metric"][label]: value(s) for s in series}


def test_the_job_metrics_say_what_the_job_was(observed):
    assert _by(observed, "horovod_ray_job_state", "state") == {
        "created": 0, "starting": 0, "running": 1, "stopping": 0, "stopped": 0, "failed": 0,
    }  # fmt: skip
    for name, expected in (
        ("horovod_ray_job_ranks_wanted", 2),
        ("horovod_ray_job_ranks_alive", 2),
        ("horovod_ray_job_restarts", 0),
        ("horovod_ray_job_elastic_resets", 0),
    ):
        assert [value(s) for s in observed["series"][name]] == [expected], name
    phases = _by(observed, "horovod_ray_job_start_seconds", "phase")
    assert set(phases) == {"placement", "actors", "environment", "rendezvous", "hvd_init"}
    assert all(0 < seconds < 120 for seconds in phases.values()), phases
    assert phases["rendezvous"] <= phases["hvd_init"]


def test_the_rank_metrics_count_what_the_ranks_did(observed):
    assert _by(observed, "horovod_ray_reports_total", "rank") == {"0": STEPS, "1": STEPS}
    values = {
        (s["metric"]["rank"], s["metric"]["metric"]): value(s)
        for s in observed["series"]["horovod_ray_report_value"]
    }
    assert values[("0", "step")] == values[("1", "step")] == STEPS - 1
    assert values[("1", "loss")] == pytest.approx(1.0 / STEPS)
    for rank in ("0", "1"):
        assert _by(observed, "horovod_ray_collectives_total", "rank")[rank] >= STEPS
        assert _by(observed, "horovod_ray_collective_bytes_total", "rank")[rank] >= (
            STEPS * TENSORS * ELEMENTS * 4
        )
        assert 0 < _by(observed, "horovod_ray_collective_seconds_total", "rank")[rank] < 60
        # Between calls: no stall; during the pause in the call, one.
        assert _by(observed, "horovod_ray_stall_seconds", "rank")[rank] == 0
        assert _by(observed, "stall_peak", "rank")[rank] >= PAUSE_S / 4  # sampled each second


def test_rank_0s_uploads_are_counted(observed):
    uploads = STEPS // CHECKPOINT_EVERY
    assert _by(observed, "horovod_ray_checkpoint_uploads_total", "rank") == {"0": uploads}
    assert _by(observed, "horovod_ray_checkpoint_upload_bytes_total", "rank")["0"] >= (
        uploads * CHECKPOINT_BYTES
    )
    assert 0 < _by(observed, "horovod_ray_checkpoint_upload_seconds_total", "rank")["0"] < 60
    assert _by(observed, "horovod_ray_checkpoint_upload_queue", "rank") == {"0": 0}
    assert _by(observed, "horovod_ray_checkpoint_upload_failures", "rank") == {"0": 0}


def test_the_rank_that_sleeps_is_named_the_straggler(observed):
    waited = _by(observed, "horovod_ray_waited_for_seconds_total", "rank")
    # Once a step, not once per tensor of it.
    assert 0.8 * STEPS * SLEEP_S <= waited["1"] <= 1.3 * STEPS * SLEEP_S, waited
    assert waited.get("0", 0.0) < 0.1 * waited["1"], waited
    assert _by(observed, "horovod_ray_waited_for_total", "rank")["1"] >= 0.8 * STEPS


def test_every_dashboard_panel_returns_data(observed):
    empty = [(title, expr) for title, expr, series in observed["panels"] if not series]
    assert not empty
    (slowest,) = [series for title, _, series in observed["panels"] if "Slowest" in title]
    top = max(slowest, key=value)
    assert top["metric"]["rank"] == "1" and value(top) > 0


def test_status_lists_the_job_with_its_slowest_rank(observed):
    status = observed["status"]
    assert status.returncode == 0, status.stderr[-3000:]
    (listed,) = [job for job in json.loads(status.stdout) if job["id"] == observed["job_id"]]
    (job,) = [job for job in observed["jobs"] if job.id == observed["job_id"]]
    assert listed == job.as_dict() | {"last_report_age_s": listed["last_report_age_s"]}
    assert (job.name, job.state, job.kind) == ("observed", "running", "static")
    assert (job.ranks_wanted, job.ranks_alive, job.restarts, job.resets) == (2, 2, 0, 0)
    assert (job.reports, job.step) == (STEPS, STEPS - 1)
    assert 0 <= job.last_report_age_s < 120
    assert job.slowest_rank == 1
    assert job.slowest_waited_s >= 0.8 * STEPS * SLEEP_S


def test_a_stopped_job_says_so_and_leaves_the_running_list(observed):
    (job,) = [job for job in observed["ended"] if job.id == observed["job_id"]]
    assert (job.state, job.ranks_alive) == ("stopped", 0)
    assert observed["job_id"] not in [job.id for job in observed["running_after"]]


def test_the_timeline_comes_to_the_driver(observed):
    events = json.loads(observed["timeline"].read_text())  # horovod keeps it valid JSON
    names = {event.get("name") for event in events}
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= names, sorted(names)[:20]
    tensors = [e["args"].get("name") for e in events if e.get("name") == "process_name"]
    assert "allreduce.gradient0" in tensors
    # Rank 1's ready mark comes about SLEEP_S after rank 0's in each negotiation.
    marks = [(e["name"], e["ts"]) for e in events if e.get("ph") == "X"]
    gaps = [
        b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False) if (a[0], b[0]) == ("0", "1")
    ]
    assert len(gaps) >= STEPS - 1 and sorted(gaps)[len(gaps) // 2] >= 0.8 * SLEEP_S * 1e6
