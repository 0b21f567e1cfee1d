"""Reported metrics as a run stores them, without Ray: checked at report(), stored as
JSON, flattened with "/" to score checkpoints."""

from __future__ import annotations

import os

import pytest

from horovod_ray import ConfigError
from horovod_ray.checkpoints import spec, store, upload
from horovod_ray.checkpoints.metrics import checked_metrics, flatten
from horovod_ray.rank import report
from test.checkpoints.test_store import _folder

pytestmark = pytest.mark.unit


def test_nested_metrics_flatten_with_slashes_as_ray_train_does():
    assert flatten({"a": {"b": {"c": 1}, "d": 2}, "e": {}}) == {"a/b/c": 1, "a/d": 2, "e": {}}


def test_one_dict_may_appear_twice_but_not_inside_itself():
    """A dict reached twice, with no cycle, was refused as one that "holds itself";
    JSON writes it twice."""
    loss = {"loss": 0.2}
    assert checked_metrics({"train": loss, "best": {"of": loss}}) == {
        "train": loss,
        "best": {"of": loss},
    }
    cycle: dict = {"a": {}}
    cycle["a"]["back"] = cycle
    with pytest.raises(ConfigError, match="holds itself"):
        checked_metrics(cycle)


def test_metrics_that_cannot_be_stored_are_refused_before_a_callback_sees_them(
    tmp_path, monkeypatch, fresh_rank_session
):
    """With a storage, report() handed such metrics to the driver's callbacks, then
    refused them."""
    for key, value in spec.create(str(tmp_path), "run").to_env(None).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    posted: list[dict] = []
    monkeypatch.setattr(report.logs, "post", posted.append)
    with pytest.raises(ConfigError, match="cannot be stored as JSON"):
        report.report({"per_class": [{1: 0.5, "a": 0.2}]})
    report.report({"loss": 0.1})
    report.flush()
    assert posted == [{"loss": 0.1}]
    assert sorted(os.listdir(tmp_path / "run")) == ["metrics.json"]


def test_metrics_that_cannot_be_stored_are_refused_at_report_and_poison_nothing(tmp_path):
    """A metric keyed by an int used to pass report(), then fail the marker's JSON after
    the upload (a bare TypeError): a folder without its marker, and every later
    checkpoint refused as "checkpoint upload failed"."""
    with pytest.raises(ConfigError, match=r"keys must be str, got 1 \(int\) at the top level"):
        report.report({"loss": 0.5, 1: 2}, _folder(tmp_path, "c0", "0"))
    with pytest.raises(ConfigError, match=r"got 2 \(int\) at val"):
        report.report({"val": {"loss": 0.1, 2: 3}})
    uploader = upload.Uploader(spec.create(str(tmp_path), "run"))
    for step, metrics in enumerate([{"loss": 0.5, 1: 2}, {"per_class": [{1: 0.5, "a": 0.2}]}]):
        with pytest.raises(ConfigError, match="cannot be stored as JSON"):
            uploader.submit(metrics, _folder(tmp_path, f"c{step + 1}", "1"))
    uploader.submit({"loss": 0.4}, _folder(tmp_path, "c3", "3"))
    uploader.flush()
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint_000001",
        "checkpoint_000001.json",
        "metrics.json",
    ]


def test_a_metric_that_is_not_one_number_is_stored_as_its_repr(tmp_path):
    import numpy as np  # in both lines; torch is not in the 2023 one

    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, str(_folder(tmp_path, "c1", "1").path), {"v": np.array([1, 2])})
    (entry,) = store.list_entries(storage)
    assert entry.metrics == {"v": "array([1, 2])"}
