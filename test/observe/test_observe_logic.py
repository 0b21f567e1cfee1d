"""The metrics' catalog against the docs, the job table's logic, the status table and
the settings that turn the observability on and off: pure logic, no Ray."""

from __future__ import annotations

import os
import re

import pytest

from horovod_ray import ConfigError, RayExecutor
from horovod_ray.cli.status import table
from horovod_ray.observe import registry
from horovod_ray.observe.catalog import CATALOG, JOB, RANK
from horovod_ray.observe.job import METRICS_ENV, JobTelemetry
from horovod_ray.settings import create_settings
from test.conftest import ROOT

pytestmark = pytest.mark.unit

_ROW = re.compile(
    r"^   \* - ``(horovod_ray_\w+)``\n     - (\w+)\n     - (.*)\n     - (.*)\n     - (.*)\n"
    r"     - (.*)$",
    re.MULTILINE,
)


def test_the_docs_table_lists_every_metric_as_the_catalog_has_it():
    text = (ROOT / "docs" / "observability.rst").read_text()
    rows = [
        (name, kind, tuple(labels.split(", ")), unit, source, meaning)
        for name, kind, labels, unit, source, meaning in _ROW.findall(text)
    ]
    assert rows == [(m.name, m.kind, m.labels, m.unit, m.source, m.meaning) for m in CATALOG]


@pytest.mark.parametrize("metric", CATALOG, ids=lambda metric: metric.name)
def test_every_metric_is_named_and_labelled_by_the_rules(metric):
    assert metric.name.startswith("horovod_ray_")
    assert metric.kind in ("gauge", "counter")
    assert metric.name.endswith("_total") == (metric.kind == "counter")
    assert metric.labels[: len(JOB)] == JOB
    assert "job" not in metric.labels  # Prometheus's own label for each scrape target
    if metric.source in ("every rank", "rank 0") and "rank" in metric.labels:
        assert metric.labels[: len(RANK)] == RANK or metric.labels == (*JOB, "rank")


def _record(state="running", ray_job_id="01000000") -> dict:
    return {
        "id": "abc", "name": "train", "kind": "static", "state": state, "ranks_wanted": 4,
        "ranks_alive": 4, "restarts": 1, "resets": 0, "started_at": 100.0,
        "ray_job_id": ray_job_id, "driver_pid": 1,
    }  # fmt: skip


def test_a_job_whose_driver_is_gone_is_lost_with_no_ranks():
    job = registry._status(_record(), {}, driver_gone=True, now=200.0)
    assert (job.state, job.ranks_alive) == ("lost", 0)
    assert (job.reports, job.step, job.last_report_age_s, job.slowest_rank) == (0, None, None, None)


def test_a_stopped_job_stays_stopped_when_its_driver_ends():
    job = registry._status(_record("stopped"), {}, driver_gone=True, now=200.0)
    assert (job.state, job.ranks_alive) == ("stopped", 0)


def test_rank_0s_record_gives_the_last_report_and_the_slowest_rank():
    rank0 = {"reports": 7, "step": 6.0, "last_report_at": 190.0, "slowest_rank": 3,
             "slowest_waited_s": 2.5}  # fmt: skip
    job = registry._status(_record(), rank0, driver_gone=False, now=200.0)
    assert (job.state, job.ranks_alive, job.restarts) == ("running", 4, 1)
    assert (job.reports, job.step, job.last_report_age_s) == (7, 6.0, 10.0)
    assert (job.slowest_rank, job.slowest_waited_s) == (3, 2.5)


def test_the_status_table_has_a_row_per_job_under_its_header():
    rank0 = {"reports": 7, "step": 6.0, "last_report_at": 190.0, "slowest_rank": 3,
             "slowest_waited_s": 2.5}  # fmt: skip
    jobs = [
        registry._status(_record(), rank0, driver_gone=False, now=200.0),
        registry._status(_record("starting"), {}, driver_gone=False, now=200.0),
    ]
    lines = table(jobs).splitlines()
    assert lines[0].split() == ["NAME", "ID", "STATE", "RANKS", "RESTARTS", "STEP", "LAST",
                                "REPORT", "SLOWEST", "RANK"]  # fmt: skip
    assert lines[1].split() == ["train", "abc", "running", "4/4", "1", "6", "10s", "ago", "3",
                                "(waited", "for", "2.5s)"]  # fmt: skip
    assert lines[2].split() == ["train", "abc", "starting", "4/4", "1", "-", "-", "-"]
    assert lines[1].index("running") == lines[0].index("STATE")


def test_the_ranks_are_told_the_job_and_what_to_record():
    settings = create_settings(name="mine", find_stragglers=True)
    env = JobTelemetry.of(settings, elastic=False).rank_env()
    assert env["HOROVOD_RAY_JOB_NAME"] == "mine"
    assert env[METRICS_ENV] == "on,stragglers"
    assert JobTelemetry.of(create_settings(), False).rank_env()[METRICS_ENV] == "on"
    assert "HOROVOD_CACHE_CAPACITY" not in env  # each rank decides (rank.metrics.start)
    values = JobTelemetry.of(create_settings(report_values=True), False)
    assert values.rank_env()[METRICS_ENV] == "on,values"
    quiet = JobTelemetry.of(create_settings(metrics=False), False, name="train").rank_env()
    assert quiet["HOROVOD_RAY_JOB_NAME"] == "train"
    assert METRICS_ENV not in quiet


def test_a_job_is_named_by_its_settings_then_its_storage_then_its_function(tmp_path):
    assert JobTelemetry.of(create_settings(name="given"), False, name="fn").name == "given"
    stored = create_settings(storage_path=str(tmp_path), name="folder")
    assert JobTelemetry.of(stored, False, name="fn").name == "folder"
    assert JobTelemetry.of(create_settings(), False, name="fn").name == "fn"
    assert JobTelemetry.of(create_settings(), False).name == "job"


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"metrics": 1}, "metrics must be True or False, got 1"),
        ({"report_values": "yes"}, "report_values must be True or False"),
        ({"find_stragglers": None}, "find_stragglers must be True or False"),
        ({"timeline": ""}, "timeline must be a file path or None, got ''"),
        ({"timeline": 3}, "timeline must be a file path or None, got 3"),
        ({"name": ""}, "name must be a non-empty str or None"),
    ],
)
def test_bad_observability_settings_are_refused_naming_them(kwargs, text):
    with pytest.raises(ConfigError, match=re.escape(text)) as raised:
        create_settings(**kwargs)
    assert raised.value.parameter == next(iter(kwargs))


def test_a_timeline_path_is_the_drivers_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert create_settings(timeline="t.json").timeline == str(tmp_path / "t.json")


def test_an_elastic_job_refuses_a_timeline_before_anything_is_taken():
    with pytest.raises(ConfigError, match="timeline is for static jobs") as raised:
        RayExecutor(create_settings(timeline="t.json"), min_workers=2)
    assert raised.value.parameter == "timeline"


@pytest.mark.parametrize(
    ("modes", "users", "cache"),
    [
        ("on,stragglers", None, "0"),  # the attribution needs the cache off
        ("on,stragglers", "512", "512"),  # the user's own value wins
        ("on", None, None),  # find_stragglers=False: horovod's default
    ],
)
def test_a_rank_turns_the_cache_off_only_for_the_attribution(
    monkeypatch, modes, users, cache, fresh_rank_session
):
    from horovod_ray.rank import metrics

    monkeypatch.setenv(METRICS_ENV, modes)
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "before")  # restored after the test
    if users is None:
        monkeypatch.delenv("HOROVOD_CACHE_CAPACITY")
    else:
        monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", users)
    monkeypatch.setattr(metrics, "RankTelemetry", lambda *args, **kwargs: object())
    metrics.start(node="127.0.0.1")
    assert os.environ.get("HOROVOD_CACHE_CAPACITY") == cache


def test_a_command_lines_job_is_named_by_its_script_else_its_program():
    from horovod_ray.cli.main import _job_name

    assert _job_name(["python", "-u", "dir/train.py", "--epochs", "3"]) == "train.py"
    assert _job_name(["--", "./bin/run.sh", "x"]) == "run.sh"
    assert _job_name([]) is None


def test_ended_jobs_records_go_an_hour_after_they_ended_and_beyond_the_latest(monkeypatch):
    monkeypatch.setattr(registry, "MAX_ENDED", 2)
    now = 10_000.0
    ended_at = {"old": now - 3601, "a": now - 30, "b": now - 20, "c": now - 10}
    assert registry.expired(ended_at, now) == ["old", "a"]
    assert registry.expired({"a": now - 30}, now) == []
