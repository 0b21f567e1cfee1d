"""``report(validation=...)``'s parts without Ray: the checks, the marker's record, the
keep policy, and the driver's Validator running validations in threads (as in a local
run) over a real run folder. A real job's Ray tasks are in test_report_options."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.train import Checkpoint, CheckpointConfig, ValidationConfig
from ray.train.v2.api.validation_config import ValidationTaskConfig

import horovod_ray
from horovod_ray import ConfigError, Result
from horovod_ray.checkpoints import choices, spec, store
from horovod_ray.checkpoints import validation as v
from horovod_ray.checkpoints.validator import Validator
from horovod_ray.rank import report
from horovod_ray.settings import create_settings

pytestmark = pytest.mark.unit


def _score(checkpoint, scale=1, fail=False, sleep_s=0.0, exit_code=None):
    """A validation: the checkpoint's number, scaled."""
    if fail:
        raise RuntimeError("the validation set is missing")
    if exit_code is not None:
        sys.exit(exit_code)
    time.sleep(sleep_s)
    with checkpoint.as_directory() as folder:
        return {"val_score": scale * int(Path(folder, "step").read_text())}


def _config(**task) -> v.Validation:
    return v.check_config(
        ValidationConfig(_score, task_config=ValidationTaskConfig(fn_kwargs=task or None))
    )


def _commit(storage, tmp_path, step: int, request: dict | None) -> int:
    folder = tmp_path / f"local_{step}"
    folder.mkdir()
    (folder / "step").write_text(str(step))
    return store.commit(storage, str(folder), {"step": step}, validation=request)


def _marker(storage, index: int) -> dict:
    return json.loads(Path(storage.run_path, f"checkpoint_{index:06d}.json").read_text())


def test_the_run_config_is_checked_when_the_settings_are_made(tmp_path):
    class Locked:
        lock = threading.Lock()

        def __call__(self, checkpoint):
            return {}

    bad = [
        ("not a config", "ray.train.ValidationConfig"),
        (ValidationConfig("fn"), "must be a function"),
        (ValidationConfig(_score, ValidationTaskConfig(fn_kwargs={"x": {1, 2}})), "JSON"),
        (ValidationConfig(_score, ray_remote_kwargs={"num_cpu": 1}), "ray.remote's options"),
        (ValidationConfig(Locked()), "cannot be pickled"),
        # Ray would read no fn_kwargs off a dict, and run fn without them.
        (ValidationConfig(_score, task_config={"fn_kwargs": {"scale": 2}}), "TaskConfig or"),
        (ValidationConfig(_score, ValidationTaskConfig({"checkpoint": 1})), "'checkpoint'"),
        (ValidationConfig(_score, SimpleNamespace(fn_kwargs={}, timeout_s=float("nan"))), "> 0"),
        (ValidationConfig(_score, ray_remote_kwargs={"num_returns": 2}), "returning one"),
    ]
    for config, message in bad:
        with pytest.raises(ConfigError, match=message) as raised:
            create_settings(storage_path=str(tmp_path), validation_config=config)
        assert raised.value.parameter == "validation_config"
    with pytest.raises(ConfigError, match="give storage_path") as raised:
        create_settings(validation_config=ValidationConfig(_score))
    assert raised.value.parameter == "validation_config"


def test_a_reports_request_is_checked_and_merged_over_the_runs_defaults():
    assert v.task_request(False, True, False) is None
    assert v.task_request(True, True, True) == {}
    task = ValidationTaskConfig(fn_kwargs={"scale": 10}, timeout_s=5)
    assert v.task_request(task, True, True) == {"fn_kwargs": {"scale": 10}, "timeout_s": 5}
    for args, message in [
        (("yes", True, True), "True, False or a ray.train.ValidationTaskConfig"),
        ((True, False, True), "needs a checkpoint"),
        ((True, True, False), "needs the run's ValidationConfig"),
        ((ValidationTaskConfig(fn_kwargs={"f": len}), True, True), "JSON values"),
    ]:
        with pytest.raises(ConfigError, match=message) as raised:
            v.task_request(*args)
        assert raised.value.parameter == "validation"
    run = v.Validation(_score, {"scale": 2, "split": "val"}, 30, {})
    assert v.task_inputs(run, {}) == ({"scale": 2, "split": "val"}, 30)
    # A report's timeout_s wins even when None, as in Ray Train.
    assert v.task_inputs(run, {"fn_kwargs": {"scale": 10}, "timeout_s": None}) == (
        {"scale": 10, "split": "val"},
        None,
    )


def test_report_refuses_validation_without_the_runs_config(tmp_path, monkeypatch):
    checkpoint = Checkpoint.from_directory(str(tmp_path))
    monkeypatch.delenv(v.VALIDATION_ENV, raising=False)
    with pytest.raises(ConfigError, match="validation_config=") as raised:
        report.report({"loss": 1.0}, checkpoint, validation=True)
    assert raised.value.parameter == "validation"


def test_the_validator_merges_metrics_and_records_each_outcome(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    requests = [
        {},  # the run's defaults: scale 2
        {"fn_kwargs": {"scale": 10}},
        None,  # no validation asked
        {"fn_kwargs": {"fail": True}},
        {"fn_kwargs": {"sleep_s": 30}, "timeout_s": 0.3},
        {"fn_kwargs": {"scale": 3}},  # after the one timed out: not held up by it
    ]
    for step, request in enumerate(requests, 1):
        _commit(storage, tmp_path, step, request)
    assert [e.status for e in store.list_entries(storage)][:3] == [
        "PENDING_VALIDATION", "PENDING_VALIDATION", "COMMITTED",
    ]  # fmt: skip
    validator = Validator(storage, _config(scale=2), in_process=True, poll_s=0.05)
    validator.start()
    validator.finish()
    entries = store.list_entries(storage)
    assert [(e.status, e.metrics) for e in entries] == [
        ("VALIDATED", {"step": 1, "val_score": 2}),
        ("VALIDATED", {"step": 2, "val_score": 20}),
        ("COMMITTED", {"step": 3}),
        ("VALIDATION_FAILED", {"step": 4}),
        ("VALIDATION_TIMEOUT", {"step": 5}),
        ("VALIDATED", {"step": 6, "val_score": 18}),
    ]
    assert _marker(storage, 4)["validation"] == {
        "status": "VALIDATION_FAILED",
        "request": {"fn_kwargs": {"fail": True}},
        "error": "RuntimeError: the validation set is missing",
    }
    # The best by the validation's metric, as Ray Train ranks a validated checkpoint.
    result = Result.from_path(storage.run_path)
    assert Path(result.get_best_checkpoint("val_score", "max").path).name == "checkpoint_000002"
    assert Path(result.get_best_checkpoint("val_score", "min").path).name == "checkpoint_000001"
    # Of equals, the oldest, as Ray's.
    assert Path(result.get_best_checkpoint("step", "min").path).name == "checkpoint_000001"
    for metric, mode, parameter in [("val_score", "best", "mode"), ("val_loss", "max", "metric")]:
        with pytest.raises(ConfigError) as raised:
            result.get_best_checkpoint(metric, mode)
        assert raised.value.parameter == parameter
    assert "'step', 'val_score'" in str(raised.value)  # what the checkpoints have


def test_a_validation_that_exits_fails_in_a_local_run_as_in_a_ray_task(tmp_path):
    """``sys.exit()`` in the function raises SystemExit, which is no Exception: the thread
    of a local run's validation ended without an outcome, and the run never returned."""
    storage = spec.create(str(tmp_path), "run")
    _commit(storage, tmp_path, 1, {"fn_kwargs": {"exit_code": 3}})
    validator = Validator(storage, _config(), in_process=True, poll_s=0.05)
    validator.start()
    finishing = threading.Thread(target=validator.finish, daemon=True)
    finishing.start()
    finishing.join(30)
    assert not finishing.is_alive(), "the validator never finished"
    assert _marker(storage, 1)["validation"]["status"] == "VALIDATION_FAILED"
    assert _marker(storage, 1)["validation"]["error"] == "SystemExit: 3"


def test_an_outcome_is_recorded_only_on_the_pending_marker_it_belongs_to(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    _commit(storage, tmp_path, 1, {})
    (entry,) = store.list_entries(storage)
    written = entry.time
    # Another commit's marker under that number (an elastic job's two rank 0s).
    assert not v.record(storage, 1, v.VALIDATED, {"val": 1}, None, written=written + 1)
    assert v.record(storage, 1, v.VALIDATED, {"val": 1}, None, written=written)
    # Written once: a second outcome (a retry, a second driver) changes nothing.
    assert not v.record(storage, 1, v.FAILED, {}, "late", written=written)
    assert not v.record(storage, 2, v.VALIDATED, {"val": 2}, None, written=written)  # none
    assert _marker(storage, 1)["validation"] == {"status": "VALIDATED", "request": {}}
    assert _marker(storage, 1)["metrics"] == {"step": 1, "val": 1}


def test_a_pending_checkpoint_is_kept_and_a_cancelled_validation_is_run_by_the_next_job(
    tmp_path,
):
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="val_score")
    storage = spec.create(str(tmp_path), "run", config)
    _commit(storage, tmp_path, 1, {"fn_kwargs": {"scale": 100, "sleep_s": 0.5}})
    _commit(storage, tmp_path, 2, None)
    _commit(storage, tmp_path, 3, None)
    # Without a score yet, the pending one would be the first to go.
    assert [e.index for e in store.list_entries(storage)] == [1, 3]
    first = Validator(storage, _config(), in_process=True, poll_s=0.05)
    first.start()
    deadline = time.monotonic() + 30
    while first._running is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until it is under way
    first.cancel()  # the job failed
    assert _marker(storage, 1)["validation"]["status"] == "PENDING_VALIDATION"
    second = Validator(storage, _config(), in_process=True, poll_s=0.05)
    second.start()
    second.finish()
    store.prune(storage)
    # Validated, it is the best: it and the latest stay.
    assert [(e.index, e.metrics.get("val_score")) for e in store.list_entries(storage)] == [
        (1, 100),
        (3, None),
    ]


def test_a_rank_waits_for_validated_unless_it_asks_for_committed(tmp_path, monkeypatch):
    storage = spec.create(str(tmp_path), "run")
    _commit(storage, tmp_path, 1, {"fn_kwargs": {"sleep_s": 0.5}})
    monkeypatch.setattr(v, "POLL_S", 0.05)
    for key, value in {**storage.to_env(None), v.VALIDATION_ENV: "1"}.items():
        monkeypatch.setenv(key, value)
    committed = horovod_ray.get_all_reported_checkpoints("COMMITTED")
    assert [r.status.value for r in committed] == ["PENDING_VALIDATION"]
    assert horovod_ray.get_all_reported_checkpoints(timeout_s=0.1)[0].status.value == (
        "PENDING_VALIDATION"
    )
    validator = Validator(storage, _config(), in_process=True, poll_s=0.05)
    validator.start()
    try:
        validated = horovod_ray.get_all_reported_checkpoints()
    finally:
        validator.finish()
    assert [(r.status.value, r.metrics) for r in validated] == [
        ("VALIDATED", {"step": 1, "val_score": 1})
    ]


def test_the_keep_policy_never_removes_a_pending_checkpoint():
    entries = [
        choices.Entry(1, True, {"loss": 0.9}, validation={"status": "PENDING_VALIDATION"}),
        choices.Entry(2, True, {"loss": 0.1}),
        choices.Entry(3, True, {"loss": 0.5}, validation={"status": "VALIDATED"}),
        choices.Entry(4, True, {"loss": 0.7}),
    ]
    assert choices.to_remove(entries, 1, "loss", "min", 1) == [3]


def test_a_second_commit_under_the_number_is_validated_with_its_own_request(tmp_path):
    """Two processes committed checkpoint 1 (an elastic job's former and new rank 0):
    the first one's outcome is not written into the second's marker, which is then
    validated itself, not left pending."""
    storage = spec.create(str(tmp_path), "run")
    _commit(storage, tmp_path, 1, {"fn_kwargs": {"sleep_s": 0.5}})
    validator = Validator(storage, _config(), in_process=True, poll_s=0.05)
    validator.start()
    deadline = time.monotonic() + 30
    while validator._running is None and time.monotonic() < deadline:
        time.sleep(0.02)
    marker = {**_marker(storage, 1), "time": time.time() + 1}
    marker["validation"] = {"status": "PENDING_VALIDATION", "request": {"fn_kwargs": {"scale": 5}}}
    Path(storage.run_path, "checkpoint_000001.json").write_text(json.dumps(marker))
    validator.finish()
    assert [(e.status, e.metrics) for e in store.list_entries(storage)] == [
        ("VALIDATED", {"step": 1, "val_score": 5})
    ]
