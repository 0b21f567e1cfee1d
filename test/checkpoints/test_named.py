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
from horovod_ray.checkpoints import choices, job, spec, store, upload
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
    env = job.job_env(storage)
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
    env = job.job_env(storage)
    assert env[spec.FIRST_INDEX_ENV] == "3"
    # The next job's first commit removes it, marker and folder.
    store.commit(storage, _folder(tmp_path, "c3", "3").path, {"step": 3}, stale_below=3)
    assert sorted(os.listdir(run)) == [
        "checkpoint_000001.json", "checkpoint_000003", "checkpoint_000003.json", "first",
    ]  # fmt: skip


def test_a_name_a_committed_checkpoint_has_fails_the_upload_and_keeps_it(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, _folder(tmp_path, "c1", "1").path, {"step": 1}, dir_name="epoch_1")
    for name in ("epoch_1", "EPOCH_1"):  # the same folder where case does not count
        with pytest.raises(CheckpointError, match=r"folder '(?i:epoch_1)' is checkpoint 1's"):
            store.commit(storage, _folder(tmp_path, f"c2{name}", "2").path, {}, dir_name=name)
    assert (tmp_path / "run" / "epoch_1" / "model.txt").read_text() == "1"
    assert [e.index for e in store.list_entries(storage)] == [1]


def _cut_off(run, index: int, name: str) -> None:
    """What an upload to a named folder leaves when its job fails during it."""
    run.mkdir(parents=True, exist_ok=True)
    (run / f"checkpoint_{index:06d}.json").write_text(json.dumps({"index": index, "folder": name}))
    _folder(run, name, "partial")


def test_an_earlier_jobs_cut_off_upload_to_the_name_is_replaced(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, _folder(tmp_path, "c1", "1").path, {"step": 1})
    _cut_off(tmp_path / "run", 2, "epoch_2")
    store.commit(storage, _folder(tmp_path, "c3", "3").path, {"step": 3}, stale_below=3,
                 dir_name="epoch_2")  # fmt: skip
    assert (tmp_path / "run" / "epoch_2" / "model.txt").read_text() == "3"
    assert [(e.index, e.committed) for e in store.list_entries(storage)] == [(1, True), (3, True)]


def test_an_upload_of_this_jobs_under_way_to_the_name_is_not_touched(tmp_path):
    """In an elastic job the former rank 0 may still be uploading to the name when the new
    one reports it again: that upload's marker and folder stay, this one fails."""
    storage = spec.create(str(tmp_path), "run")
    _cut_off(tmp_path / "run", 1, "epoch_3")
    with pytest.raises(CheckpointError, match="'epoch_3' is being uploaded as checkpoint 1"):
        store.commit(storage, _folder(tmp_path, "c2", "2").path, {}, stale_below=1,
                     dir_name="epoch_3")  # fmt: skip
    assert (tmp_path / "run" / "epoch_3" / "model.txt").read_text() == "partial"
    assert (tmp_path / "run" / "checkpoint_000001.json").exists()


def test_a_folder_that_is_no_checkpoints_is_never_written_into(tmp_path):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(1))
    (tmp_path / "run" / "tensorboard").mkdir(parents=True)
    (tmp_path / "run" / "tensorboard" / "events").write_text("mine")
    with pytest.raises(CheckpointError, match="'tensorboard' is a folder .* no checkpoint's"):
        store.commit(storage, _folder(tmp_path, "c1", "1").path, {}, dir_name="tensorboard")
    assert os.listdir(tmp_path / "run" / "tensorboard") == ["events"]
    assert store.list_entries(storage) == []


def test_a_named_upload_that_fails_leaves_its_marker_naming_the_folder(tmp_path):
    storage = spec.create(str(tmp_path), "run")

    def half(checkpoint, destination):
        os.makedirs(destination)
        raise OSError("the network went")

    with pytest.raises(CheckpointError, match="the network went"):
        store.commit(storage, _folder(tmp_path, "c1", "1").path, {}, upload_fn=half,
                     dir_name="epoch_1")  # fmt: skip
    assert [(e.index, e.committed, e.folder) for e in store.list_entries(storage)] == [
        (1, False, "epoch_1"),
    ]  # fmt: skip
    # The next job's start removes its folder, and its first commit the marker.
    job.job_env(storage)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint_000001.json"]
    store.commit(storage, _folder(tmp_path, "c2", "2").path, {}, stale_below=2)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint_000002", "checkpoint_000002.json"]


def test_a_no_upload_folder_on_a_cut_off_uploads_name_is_not_removed(tmp_path):
    """An earlier job's upload to "epoch_3" was cut off; this job's rank 0 wrote
    "epoch_3" itself (NO_UPLOAD) while an upload before it was still queued: that
    upload's commit removed the earlier job's marker, not the new folder."""
    storage = spec.create(str(tmp_path), "run")
    run = tmp_path / "run"
    _cut_off(run, 1, "epoch_3")
    env = job.job_env(storage)  # the job starts: the cut-off folder goes
    assert not (run / "epoch_3").exists()
    first = int(env[spec.FIRST_INDEX_ENV])
    _folder(run, "epoch_3", "mine")  # rank 0 writes it, then reports it
    store.commit(storage, _folder(tmp_path, "c2", "2").path, {"step": 2}, stale_below=first)
    store.commit(storage, None, {"step": 3}, stale_below=first, dir_name="epoch_3")
    assert (run / "epoch_3" / "model.txt").read_text() == "mine"
    assert [(e.index, e.committed, e.folder) for e in store.list_entries(storage)] == [
        (2, True, "checkpoint_000002"), (3, True, "epoch_3"),
    ]  # fmt: skip


def test_an_uncommitted_no_upload_folder_outlives_a_stale_marker_of_its_name(tmp_path):
    """A driver died during an upload to "best"; the next job wrote its NO_UPLOAD folder
    "best" and failed before committing it: its end's keep policy removed the earlier
    job's marker, and with it the user's folder, which the docs say stays."""
    storage = spec.create(str(tmp_path), "run")
    run = tmp_path / "run"
    _cut_off(run, 1, "best")
    checkpoints = job.JobCheckpoints(storage, None)
    checkpoints.rank_env()  # the job starts: the cut-off folder goes
    _folder(run, "best", "mine")  # rank 0 writes it; the job fails before it is committed
    checkpoints.end(finished=False)
    assert (run / "best" / "model.txt").read_text() == "mine"
    assert sorted(os.listdir(run)) == ["best"]  # the stale marker is gone
    # This job's own cut-off upload to a name still goes, folder too.
    _cut_off(run, 2, "epoch_2")
    checkpoints = job.JobCheckpoints(storage, None)
    checkpoints.rank_env()
    _cut_off(run, 3, "epoch_3")
    checkpoints.end(finished=False)
    assert sorted(os.listdir(run)) == ["best"]


def test_a_kept_checkpoints_folder_is_never_removed_with_another_marker(tmp_path):
    """Two markers naming one folder (two processes that chose the same name at once):
    removing the older one does not take the folder the newer one is in."""
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(1))
    run = tmp_path / "run"
    _folder(run, "epoch_3", "3")
    for index in (1, 2):
        marker = {"index": index, "folder": "epoch_3", "metrics": {"step": index}}
        (run / f"checkpoint_{index:06d}.json").write_text(json.dumps(marker))
    store.prune(storage)
    assert sorted(os.listdir(run)) == ["checkpoint_000002.json", "epoch_3"]


def test_a_named_start_checkpoint_stays_while_the_job_runs(
    tmp_path, monkeypatch, fresh_rank_session
):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(1))
    store.commit(storage, _folder(tmp_path, "c1", "1").path, {"step": 1}, dir_name="start")
    for name, value in job.job_env(storage).items():
        monkeypatch.setenv(name, value)
    uploader = report._rank_uploader()
    try:
        uploader.submit({"step": 2}, _folder(tmp_path, "c2", "2"))
        uploader.flush()
        assert "start" in os.listdir(tmp_path / "run")  # num_to_keep 1, but the start
    finally:
        report.close_uploader()


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
    with pytest.raises(CheckpointError, match="must be a folder in the run's when it is committed"):
        store.commit(storage, None, {"step": 3}, dir_name="missing")
    assert [e.index for e in store.list_entries(storage)] == [2]


def _linked(link, target) -> Checkpoint:
    target.mkdir()
    link.symlink_to(target)
    return Checkpoint.from_directory(str(link))


def test_report_checks_a_no_upload_checkpoint_is_in_the_run(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    inside = _folder(tmp_path / "run", "epoch_1", "1")
    assert report_options.folder_in_the_run(inside, storage, None) == "epoch_1"
    assert report_options.folder_in_the_run(inside, storage, "epoch_1") == "epoch_1"
    cases = [
        (_folder(tmp_path, "elsewhere", "x"), None, "checkpoint", "must be a folder in the run"),
        (_folder(tmp_path / "run" / "a", "deeper", "x"), None, "checkpoint", "in the run's"),
        (_folder(tmp_path / "run", "checkpoint_000009", "x"), None, "checkpoint", "keeps"),
        (_linked(tmp_path / "run" / "link", tmp_path / "far"), None, "checkpoint", "a link"),
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
