"""Checkpoints in folders of their own names (``report(checkpoint_dir_name=...)``) and
checkpoints committed where they are (``NO_UPLOAD``), without Ray: the run's folder, its
keep policy and its reading back."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from ray.train import Checkpoint, CheckpointConfig

from horovod_ray import CheckpointError, ConfigError, Result
from horovod_ray.checkpoints import choices, spec, store, upload
from horovod_ray.rank import report, report_options

pytestmark = pytest.mark.unit


def _folder(parent, name: str, text: str) -> Checkpoint:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / "model.txt").write_text(text)
    return Checkpoint.from_directory(str(folder))


@pytest.mark.parametrize(
    "name, fine",
    [
        ("epoch_3", True),
        ("checkpoint_epoch_3", True),
        ("a/b", False),
        ("..", False),
        (".hidden", False),
        ("", False),
        (3, False),
        ("checkpoint_000003", False),  # a numbered checkpoint's
        ("checkpoint_000003.json", False),
        ("metrics.json", False),
        ("x.json.1a2b.partial", False),
    ],
)
def test_dir_name_problem(name, fine):
    assert (choices.dir_name_problem(name) is None) == fine


def test_named_checkpoints_count_in_commit_order_and_the_keep_policy_removes_them(tmp_path):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(2, "loss", "min"))
    uploader = upload.Uploader(storage)
    for step, loss in enumerate([0.5, 0.2, 0.9, 0.7], start=1):
        # Names that sort otherwise than the order they were committed in.
        name = {1: "zeta", 2: "alpha", 3: None, 4: "mid"}[step]
        uploader.submit({"step": step, "loss": loss}, _folder(tmp_path, f"c{step}", str(step)),
                        dir_name=name)  # fmt: skip
    uploader.flush()
    run = tmp_path / "run"
    # 1 and 2 (the best two) and 4 (the latest) are kept; 3 went.
    assert sorted(os.listdir(run)) == [
        "alpha", "checkpoint_000001.json", "checkpoint_000002.json", "checkpoint_000004.json",
        "metrics.json", "mid", "zeta",
    ]  # fmt: skip
    assert json.loads((run / "checkpoint_000004.json").read_text())["folder"] == "mid"
    entries = store.list_entries(storage)
    assert [(e.index, e.folder) for e in entries] == [(1, "zeta"), (2, "alpha"), (4, "mid")]
    result = Result.from_path(str(run))
    assert result.checkpoint.path == f"{run}/mid"
    assert [c.path for c, _ in result.best_checkpoints] == [f"{run}/{n}" for n in
                                                           ("zeta", "alpha", "mid")]  # fmt: skip
    # A job starting now resumes from the latest, whatever its folder's name; the keep
    # policy keeps that one while the job runs.
    env = store.job_env(storage)
    assert env[spec.CHECKPOINT_ENV] == f"{run}/mid"
    assert store.index_at(storage, env[spec.CHECKPOINT_ENV]) == 4
    assert store.index_at(storage, f"{run}/alpha") == 2
    assert store.index_at(storage, f"{run}/nothing") is None
    # Named ones go too: with one kept, only the latest stays.
    uploader.submit({"step": 5, "loss": 0.1}, _folder(tmp_path, "c5", "5"), dir_name="last")
    uploader.flush()
    store.prune(dataclasses.replace(storage, num_to_keep=1))
    assert sorted(os.listdir(run)) == ["checkpoint_000005.json", "last", "metrics.json"]


def test_a_named_upload_cut_off_is_never_the_latest_and_is_removed(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, _folder(tmp_path, "c1", "1").path, {"step": 1}, dir_name="first")
    # What a job that failed while uploading checkpoint 2 to "second" leaves: the marker
    # without metrics that names the folder, and part of the folder.
    run = tmp_path / "run"
    (run / "checkpoint_000002.json").write_text(json.dumps({"index": 2, "folder": "second"}))
    (run / "second").mkdir()
    entries = store.list_entries(storage)
    assert [(e.index, e.committed, e.folder) for e in entries] == [
        (1, True, "first"), (2, False, "second"),
    ]  # fmt: skip
    assert choices.latest(entries).folder == "first"
    env = store.job_env(storage)
    assert env[spec.FIRST_INDEX_ENV] == "3"
    # The next job's first commit removes it, marker and folder.
    store.commit(storage, _folder(tmp_path, "c3", "3").path, {"step": 3}, stale_below=3)
    assert sorted(os.listdir(run)) == [
        "checkpoint_000001.json", "checkpoint_000003", "checkpoint_000003.json", "first",
    ]  # fmt: skip


def test_a_name_a_committed_checkpoint_has_fails_the_upload_and_keeps_it(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, _folder(tmp_path, "c1", "1").path, {"step": 1}, dir_name="epoch_1")
    with pytest.raises(CheckpointError, match="'epoch_1' is checkpoint 1's folder"):
        store.commit(storage, _folder(tmp_path, "c2", "2").path, {"step": 2}, dir_name="epoch_1")
    assert (tmp_path / "run" / "epoch_1" / "model.txt").read_text() == "1"
    assert [e.index for e in store.list_entries(storage)] == [1]
    # An earlier job's cut-off upload to that name is replaced instead.
    (tmp_path / "run" / "checkpoint_000002.json").write_text(
        json.dumps({"index": 2, "folder": "epoch_2"})
    )
    _folder(tmp_path / "run", "epoch_2", "old")
    store.commit(storage, _folder(tmp_path, "c3", "3").path, {"step": 3}, dir_name="epoch_2")
    assert (tmp_path / "run" / "epoch_2" / "model.txt").read_text() == "3"
    assert [(e.index, e.committed) for e in store.list_entries(storage)] == [(1, True), (3, True)]


def test_no_upload_commits_the_folder_where_it_is(tmp_path):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(1))
    uploader = upload.Uploader(storage)
    uploader.submit({"step": 1}, _folder(tmp_path, "c1", "1"))
    written = _folder(tmp_path / "run", "written_by_rank_0", "2")
    uploader.submit({"step": 2}, written, dir_name="written_by_rank_0", in_place=True)
    uploader.flush()
    run = tmp_path / "run"
    assert json.loads((run / "checkpoint_000002.json").read_text())["folder"] == (
        "written_by_rank_0"
    )
    assert Result.from_path(str(run)).checkpoint.path == f"{run}/written_by_rank_0"
    assert "checkpoint_000001" not in os.listdir(run)  # num_to_keep 1
    # Nothing is committed for a folder that is not there.
    with pytest.raises(CheckpointError, match="must already be a folder in the run's"):
        store.commit(storage, None, {"step": 3}, dir_name="missing")
    assert [e.index for e in store.list_entries(storage)] == [2]


def test_report_checks_a_no_upload_checkpoint_is_in_the_run(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    inside = _folder(tmp_path / "run", "epoch_1", "1")
    assert report_options.folder_in_the_run(inside, storage, None) == "epoch_1"
    assert report_options.folder_in_the_run(inside, storage, "epoch_1") == "epoch_1"
    cases = [
        (_folder(tmp_path, "elsewhere", "x"), None, "checkpoint", "must be a folder in the run"),
        (_folder(tmp_path / "run" / "a", "deeper", "x"), None, "checkpoint", "in the run's"),
        (_folder(tmp_path / "run", "checkpoint_000009", "x"), None, "checkpoint", "keeps"),
        (inside, "epoch_2", "checkpoint_dir_name", "stays in its folder 'epoch_1'"),
    ]
    for checkpoint, dir_name, parameter, text in cases:
        with pytest.raises(ConfigError, match=text) as raised:
            report_options.folder_in_the_run(checkpoint, storage, dir_name)
        assert raised.value.parameter == parameter


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        ({"checkpoint_dir_name": "a/b"}, "checkpoint_dir_name"),
        ({"checkpoint_dir_name": "checkpoint_000001"}, "checkpoint_dir_name"),
        (
            {"checkpoint_upload_mode": "NO_UPLOAD", "delete_local_checkpoint_after_upload": True},
            "delete_local_checkpoint_after_upload",
        ),
        (
            {"checkpoint_upload_mode": "NO_UPLOAD", "checkpoint_upload_fn": lambda c, d: c},
            "checkpoint_upload_fn",
        ),
    ],
)
def test_report_refuses_bad_names_and_what_no_upload_cannot_do(tmp_path, kwargs, parameter):
    with pytest.raises(ConfigError, match=parameter) as raised:
        report.report({"loss": 1.0}, _folder(tmp_path, "c", "x"), **kwargs)
    assert raised.value.parameter == parameter
