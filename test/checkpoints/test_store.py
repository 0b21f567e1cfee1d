"""The run's folder without Ray: what is kept, what counts as committed, how the storage
travels to a rank, and the upload thread."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

import numpy
import pyarrow.fs
import pytest
from ray.train import Checkpoint, CheckpointConfig

from horovod_ray import CheckpointError, ConfigError, Result
from horovod_ray.checkpoints import choices, files, job, spec, store, upload
from horovod_ray.checkpoints.choices import Entry
from horovod_ray.rank import report

pytestmark = pytest.mark.unit


def _entries(*losses: float | None, uncommitted: tuple[int, ...] = ()) -> list[Entry]:
    entries = [
        Entry(index, True, {} if loss is None else {"loss": loss})
        for index, loss in enumerate(losses, start=1)
    ]
    return entries + [Entry(index, False) for index in uncommitted]


@pytest.mark.parametrize(
    "entries, keep, attribute, order, committing, removed",
    [
        # The docstring's example: the best two by min loss, and the latest.
        (_entries(0.5, 0.2, 0.9, 0.7), 2, "loss", "min", 4, [3]),
        (_entries(0.5, 0.2, 0.9, 0.7), 1, "loss", "max", 4, [1, 2]),
        # By age: the newest N.
        (_entries(0.5, 0.2, 0.9, 0.7), 2, None, "max", 4, [1, 2]),
        (_entries(0.5, 0.2, 0.9, 0.7), None, None, "max", 4, []),
        # A checkpoint without the metric ranks last (the latest stays anyway).
        (_entries(None, 0.2, 0.1), 1, "loss", "min", 3, [1, 2]),
        (_entries(None, 0.3, 0.1, None), 1, "loss", "min", 4, [1, 2]),
        # Unfinished folders below the one committing go; one above it is another's.
        (_entries(0.1, uncommitted=(2, 9)), None, None, "max", 3, [2]),
        (_entries(0.1, 0.2, uncommitted=(3,)), 5, None, "max", 4, [3]),
    ],
)
def test_to_remove(entries, keep, attribute, order, committing, removed):
    assert choices.to_remove(entries, keep, attribute, order, committing) == removed


def test_a_nested_score_ranks_by_its_path_as_ray_train_flattens_it():
    """Scored as "val/loss", {"val": {"loss": x}} counted as unscored: the keep policy
    kept the newest and removed the best."""
    entries = [
        Entry(index, True, {"val": {"loss": loss}, "epoch": index})
        for index, loss in enumerate([0.5, 0.1, 0.9, 0.7], start=1)
    ]
    assert choices.to_remove(entries, 1, "val/loss", "min", 5) == [1, 3]


@pytest.mark.parametrize(
    "names, stale_below, removed",
    [
        # While a job runs: an earlier job's markers only; this job's may be in writing.
        (
            ["checkpoint_000002.json.ab12.partial", "checkpoint_000005.json.cd34.partial"],
            4,
            ["checkpoint_000002.json.ab12.partial"],
        ),
        (["metrics.json.ef56.partial"], 4, []),
        # Once it has ended: every one of ours, and nothing that is not.
        (
            ["checkpoint_000005.json.cd34.partial", "metrics.json.ef56.partial"],
            None,
            ["checkpoint_000005.json.cd34.partial", "metrics.json.ef56.partial"],
        ),
        (["model.partial", "checkpoint_000001.partial", "notes.json.ab.partial"], None, []),
    ],
)
def test_stale_partials(names, stale_below, removed):
    assert choices.stale_partials(names, stale_below) == removed


def test_a_marker_left_half_written_is_removed_when_the_job_ends(tmp_path):
    """A process killed while writing a marker left checkpoint_N.json.HEX.partial for
    good: nothing ever removed it."""
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, str(_folder(tmp_path, "c1", "1").path), {"step": 1})
    earlier = tmp_path / "run" / "checkpoint_000001.json.ffff.partial"
    left = tmp_path / "run" / "checkpoint_000007.json.0a1b.partial"
    for path in (earlier, left):
        path.write_text('{"ind')
    store.commit(storage, str(_folder(tmp_path, "c2", "2").path), {"step": 2}, stale_below=2)
    assert (earlier.exists(), left.exists()) == (False, True)  # 7 may be this job's, in writing
    store.prune(storage)
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint_000001",
        "checkpoint_000001.json",
        "checkpoint_000002",
        "checkpoint_000002.json",
    ]


def test_the_checkpoint_a_job_started_from_stays_while_it_runs():
    entries = _entries(0.5, 0.2, 0.9, 0.7)
    assert choices.to_remove(entries, 1, None, "max", 4, protected=2) == [1, 3]
    assert choices.index_of("/runs/r/checkpoint_000002") == 2
    assert choices.index_of("/runs/r/checkpoint_000002.json") is None
    assert choices.index_of("") is None


def test_latest_is_committed_and_the_next_number_passes_every_folder():
    entries = _entries(0.1, 0.2, uncommitted=(3,))
    assert choices.latest(entries).index == 2
    assert choices.next_index(entries) == 4
    assert choices.latest([Entry(1, False)]) is None
    assert choices.next_index([]) == 1


def _config(num_to_keep, attribute=None, order="max") -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_to_keep=num_to_keep,
        checkpoint_score_attribute=attribute,
        checkpoint_score_order=order,
    )


@pytest.mark.parametrize(
    "kwargs, parameter, text",
    [
        ({"storage_path": None, "checkpoint_config": _config(1)}, "checkpoint_config", "give"),
        ({"storage_path": 3}, "storage_path", "a folder or a URI"),
        ({"storage_path": "x", "name": "a/b"}, "name", "without '/'"),
        ({"storage_path": "x", "name": ".."}, "name", "a folder name"),
        ({"storage_path": "x", "checkpoint_config": {"num_to_keep": 1}}, "checkpoint_config", "a "),
        # Ray's own CheckpointConfig refuses these itself; a look-alike may not.
        ({"storage_path": "x", "checkpoint_config": _config(0)}, "checkpoint_config", "None"),
        ({"storage_path": "x", "checkpoint_config": _config(True)}, "checkpoint_config", "True"),
        ({"storage_path": "x", "checkpoint_config": _config(1, 3)}, "checkpoint_config", "name"),
        (
            {"storage_path": "x", "checkpoint_config": _config(1, order="up")},
            "checkpoint_config",
            "'max' or 'min'",
        ),
        ({"storage_path": "x", "storage_filesystem": "/tmp"}, "storage_filesystem", "pyarrow"),
        ({"storage_path": "nope://bucket/x"}, "storage_path", "not a URI pyarrow can open"),
    ],
)  # fmt: skip
def test_bad_checkpoint_parameters_name_themselves(kwargs, parameter, text):
    with pytest.raises(ConfigError, match=text) as raised:
        spec.create(**kwargs)
    assert raised.value.parameter == parameter


def test_a_run_without_a_name_gets_one_from_the_time(tmp_path):
    storage = spec.create(str(tmp_path))
    assert storage.name.startswith("horovod_ray_20")
    assert storage.run_path == f"{tmp_path}/{storage.name}"


@pytest.mark.parametrize("kind", ["local", "uri", "subtree"])
def test_the_storage_reaches_a_rank_as_it_was_given(tmp_path, kind):
    if kind == "subtree":
        subtree = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
        storage = spec.create("runs", "r", CheckpointConfig(2, "loss", "min"), subtree)
    else:
        path = f"file://{tmp_path}" if kind == "uri" else str(tmp_path)
        storage = spec.create(path, "r", CheckpointConfig(2, "loss", "min"))
    env = storage.to_env(f"{storage.run_path}/checkpoint_000001")
    assert spec.RunStorage.from_env(env) == storage
    assert env[spec.CHECKPOINT_ENV] == f"{storage.run_path}/checkpoint_000001"
    assert spec.RunStorage.from_env({}) is None


def _folder(tmp_path, name: str, text: str) -> Checkpoint:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.txt").write_text(text)
    return Checkpoint.from_directory(str(folder))


def test_uploads_commit_in_order_and_keep_the_best(tmp_path):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(2, "loss", "min"))
    uploader = upload.Uploader(storage)
    for step, loss in enumerate([0.5, 0.2, 0.9, 0.7], start=1):
        checkpoint = _folder(tmp_path, f"c{step}", str(step))
        # A NumPy score ranks as its number (stored as JSON it was a repr before).
        uploader.submit({"step": step, "loss": numpy.float32(loss)}, checkpoint)
        shutil.rmtree(checkpoint.path)  # the caller's folder may go once report returns
    uploader.flush()
    result = Result.from_path(f"{tmp_path}/run")
    assert [m["step"] for _, m in result.best_checkpoints] == [1, 2, 4]
    assert result.best_checkpoints[1][1]["loss"] == pytest.approx(0.2)
    with result.checkpoint.as_directory() as directory:
        assert open(os.path.join(directory, "model.txt")).read() == "4"
    mine = f"{upload.STAGING_PREFIX}{os.getpid()}-"
    assert [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(mine)] == []


def test_the_runs_last_metrics_are_the_last_reported(tmp_path):
    """A metrics-only report waiting behind a checkpoint, replaced by a newer one, is not
    overwritten by the checkpoint's older metrics."""
    uploader = upload.Uploader(spec.create(str(tmp_path), "run"))
    uploader.submit({"step": 1}, _folder(tmp_path, "c1", "1"))
    uploader.submit_metrics({"step": 2})
    uploader.submit({"step": 3}, _folder(tmp_path, "c3", "3"))
    uploader.submit_metrics({"step": 4})
    uploader.flush()
    assert Result.from_path(f"{tmp_path}/run").metrics == {"step": 4}


def test_a_marker_that_cannot_be_read_counts_as_not_committed(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, str(_folder(tmp_path, "c1", "1").path), {"step": 1})
    (tmp_path / "run" / "checkpoint_000002").mkdir()
    (tmp_path / "run" / "checkpoint_000002.json").write_text("")  # cut off as written
    assert [(e.index, e.committed) for e in store.list_entries(storage)] == [
        (1, True),
        (2, False),
    ]
    assert job.job_env(storage)[spec.CHECKPOINT_ENV].endswith("/checkpoint_000001")


def test_result_from_path_reads_relative_paths_uris_and_filesystems(tmp_path, monkeypatch):
    storage = spec.create(str(tmp_path), "run")
    store.commit(storage, str(_folder(tmp_path, "c1", "1").path), {"step": 1})
    monkeypatch.chdir(tmp_path)
    subtree = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    for result in (
        Result.from_path("run"),
        Result.from_path(f"file://{tmp_path}/run"),
        Result.from_path("run", subtree),
    ):
        assert [m for _, m in result.best_checkpoints] == [{"step": 1}]
    with pytest.raises(ConfigError) as raised:
        Result.from_path(3)
    assert raised.value.parameter == "path"


def test_an_unfinished_upload_is_never_the_latest_and_the_next_commit_removes_it(tmp_path):
    subtree = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())
    storage = spec.create("runs", "r", None, subtree)
    store.commit(storage, str(_folder(tmp_path, "c1", "1").path), {"step": 1})
    # What a job that failed during an upload leaves: a folder without its marker.
    (tmp_path / "runs" / "r" / "checkpoint_000002").mkdir()
    entries = store.list_entries(storage)
    assert [(e.index, e.committed) for e in entries] == [(1, True), (2, False)]
    assert choices.latest(entries).index == 1
    env = job.job_env(storage)
    assert env[spec.CHECKPOINT_ENV] == "runs/r/checkpoint_000001"
    assert env[spec.FIRST_INDEX_ENV] == "3"  # folder 2 was there before the job
    uploader = upload.Uploader(storage, stale_below=int(env[spec.FIRST_INDEX_ENV]))
    uploader.submit({"step": 2}, _folder(tmp_path, "c2", "2"))  # numbered past the folder
    uploader.flush()
    assert sorted(os.listdir(tmp_path / "runs" / "r")) == [
        "checkpoint_000001",
        "checkpoint_000001.json",
        "checkpoint_000003",
        "checkpoint_000003.json",
        "metrics.json",
    ]


def test_a_failed_upload_is_raised_by_the_next_report_and_by_flush(tmp_path):
    storage = spec.create(str(tmp_path), "run")
    uploader = upload.Uploader(storage)
    uploader.submit({}, _folder(tmp_path, "c1", "1"))
    uploader.flush()
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").write_text("")  # the run's folder is now a file
    uploader.submit({}, _folder(tmp_path, "c2", "2"))
    with pytest.raises(
        CheckpointError, match=r"could not list the run.s folder .*/run: NotADirectoryError"
    ):
        uploader.flush()
    with pytest.raises(CheckpointError):
        uploader.submit({}, _folder(tmp_path, "c3", "3"))


def test_a_run_folder_that_is_not_there_is_an_error_naming_it(tmp_path):
    """It read as an empty Result (a typo in a path looked like a run with nothing);
    Ray's Result.from_path raises."""
    with pytest.raises(ConfigError, match=r"path '.*/nothing' does not exist") as raised:
        Result.from_path(f"{tmp_path}/nothing")
    assert raised.value.parameter == "path"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"path '.*/file' is a file"):
        Result.from_path(f"{tmp_path}/file")
    (tmp_path / "empty").mkdir()  # a run that has reported nothing yet
    result = Result.from_path(f"{tmp_path}/empty")
    assert (result.metrics, result.checkpoint, result.best_checkpoints) == ({}, None, [])


def test_without_a_storage_report_keeps_nothing_and_says_so_once(
    tmp_path, monkeypatch, caplog, fresh_rank_session
):
    monkeypatch.delenv(spec.STORAGE_ENV, raising=False)
    monkeypatch.setenv(spec.CHECKPOINT_ENV, "")
    with caplog.at_level(logging.WARNING, logger=report.__name__):
        for _ in range(2):
            report.report({"loss": 1.0}, checkpoint=_folder(tmp_path, f"c{_}", "x"))
    assert [r.message for r in caplog.records if "storage path" in r.message] == [
        "report(checkpoint=...) keeps nothing without a storage path: give run(..., "
        "storage_path=...), create_settings(storage_path=...) or --storage-path"
    ]
    assert report.get_checkpoint() is None


@pytest.mark.parametrize(
    "metrics, checkpoint, parameter",
    [([1], None, "metrics"), ({}, "/tmp/folder", "checkpoint")],
)
def test_report_refuses_what_is_not_a_dict_or_a_checkpoint(metrics, checkpoint, parameter):
    with pytest.raises(ConfigError) as raised:
        report.report(metrics, checkpoint=checkpoint)
    assert raised.value.parameter == parameter


def test_an_uploader_removes_the_staging_copies_of_processes_that_are_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    left = Path(tempfile.gettempdir(), f"{upload.STAGING_PREFIX}{gone}-test")
    mine = Path(tempfile.gettempdir(), f"{upload.STAGING_PREFIX}{os.getpid()}-test")
    left.mkdir()
    mine.mkdir()
    try:
        upload.Uploader(spec.create(str(tmp_path), "run"))
        assert (left.exists(), mine.exists()) == (False, True)
    finally:
        shutil.rmtree(left, ignore_errors=True)
        shutil.rmtree(mine, ignore_errors=True)


def test_a_filesystem_that_cannot_travel_to_the_ranks_is_refused_at_once():
    class Handler(pyarrow.fs.FileSystemHandler):
        lock = None

    Handler.__abstractmethods__ = frozenset()  # never used: only pickled
    handler = Handler()
    handler.lock = threading.Lock()
    with pytest.raises(ConfigError, match="cannot be pickled") as raised:
        spec.create("runs", "r", None, pyarrow.fs.PyFileSystem(handler))
    assert raised.value.parameter == "storage_filesystem"


def test_a_commands_last_upload_that_failed_fails_its_process(tmp_path):
    """A command line's ``python`` command has no call end to raise from: its exit does."""
    (tmp_path / "run").write_text("")  # the run's folder is a file: every upload fails
    env = spec.create(str(tmp_path), "run").to_env(None)
    code = (
        "import tempfile, horovod_ray\n"
        "from ray.train import Checkpoint\n"
        "horovod_ray.report({}, checkpoint=Checkpoint.from_directory(tempfile.mkdtemp()))\n"
        "print('reported')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env, "HOROVOD_RANK": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stdout == "reported\n"
    assert "a checkpoint was not persisted: could not list the run's folder" in result.stderr


def test_staging_that_fails_gives_its_room_back(tmp_path, monkeypatch):
    uploader = upload.Uploader(spec.create(str(tmp_path), "run"))

    def no_room(**_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(upload.tempfile, "mkdtemp", no_room)
    for _ in range(upload.PENDING + 1):
        with pytest.raises(OSError, match="No space left"):
            uploader.submit({}, _folder(tmp_path, f"c{_}", "x"))
    monkeypatch.undo()
    uploader.submit({"step": 1}, _folder(tmp_path, "last", "x"))  # would wait for good
    uploader.flush()
    assert [e.metrics for e in store.list_entries(uploader.storage)] == [{"step": 1}]


def test_a_checkpoint_without_the_score_attribute_is_logged_once_and_never_beats_one_with_it(
    tmp_path, caplog
):
    storage = spec.create(str(tmp_path), "run", CheckpointConfig(1, "val/loss", "min"))
    uploader = upload.Uploader(storage)
    with caplog.at_level(logging.ERROR, logger=upload.__name__):
        uploader.submit({"val": {"loss": 0.2}}, _folder(tmp_path, "c1", "1"))
        for step in (2, 3):
            uploader.submit({"step": step}, _folder(tmp_path, f"c{step}", str(step)))
        uploader.flush()
    assert [r.message for r in caplog.records] == [
        "a checkpoint was reported without 'val/loss', the checkpoint_score_attribute "
        "(reported: ['step']); it ranks below every checkpoint that has it. Report it with "
        "every checkpoint (nested metrics are named by their path, 'val/loss')"
    ]
    # The scored one and the latest stay; the unscored one between them goes.
    assert [m for _, m in Result.from_path(f"{tmp_path}/run").best_checkpoints] == [
        {"val": {"loss": 0.2}},
        {"step": 3},
    ]


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        ({"validation": "yes"}, "validation"),
        ({"checkpoint_upload_mode": "EVENTUALLY"}, "checkpoint_upload_mode"),
        ({"checkpoint_upload_fn": "s3"}, "checkpoint_upload_fn"),
        ({"delete_local_checkpoint_after_upload": "yes"}, "delete_local_checkpoint_after_upload"),
    ],
)
def test_report_refuses_ray_trains_parameters_it_does_not_honour(tmp_path, kwargs, parameter):
    with pytest.raises(ConfigError, match=f"{parameter}") as raised:
        report.report({"loss": 1.0}, _folder(tmp_path, "c", "x"), **kwargs)
    assert raised.value.parameter == parameter


def test_a_wait_for_the_reports_made_so_far_does_not_wait_for_later_ones(tmp_path, monkeypatch):
    """A drain's wait for rank 0's uploads waited for an empty queue, so a rank that went
    on reporting kept it waiting to its limit."""
    uploader = upload.Uploader(spec.create(str(tmp_path), "run"))
    released = {1: threading.Event(), 2: threading.Event()}
    commit = store.commit

    def held(storage, staging, metrics, *args):
        assert released[metrics["step"]].wait(30)
        return commit(storage, staging, metrics, *args)

    monkeypatch.setattr(upload.store, "commit", held)
    uploader.submit({"step": 1}, _folder(tmp_path, "c1", "1"))
    first = uploader.submitted()
    uploader.submit({"step": 2}, _folder(tmp_path, "c2", "2"))  # reported during the wait
    assert not uploader.wait_handled(first, 0.1)
    released[1].set()
    assert uploader.wait_handled(first, 30)
    assert not uploader.finish_submitted(0.1)  # the second is still in flight
    released[2].set()
    assert uploader.finish_submitted(30)
    assert [e.metrics for e in store.list_entries(uploader.storage)] == [{"step": 1}, {"step": 2}]


def test_a_run_folder_made_while_it_is_listed_is_listed(tmp_path):
    """pyarrow's local listing fails when the folder appears between its two looks (a
    rank writing a NO_UPLOAD folder while the first commit lists): once, it is there."""
    storage = spec.create(str(tmp_path), "run")

    class Appearing:
        def __init__(self):
            self.calls = 0

        def get_file_info(self, selector):
            self.calls += 1
            if self.calls == 1:
                (tmp_path / "run").mkdir()
                raise FileNotFoundError("Cannot list directory: [errno 2]")
            return storage.filesystem.get_file_info(selector)

    appearing = dataclasses.replace(storage, filesystem=Appearing())
    assert files.listing(appearing) == []
