"""``report()``'s options with Ray Train's meaning, and ``get_all_reported_checkpoints()``,
on a real 2-rank job with a storage path."""

from __future__ import annotations

import os

import pytest

import horovod_ray
from horovod_ray import ConfigError, WorkerFailedError


def _options(storage_path: str) -> dict:
    import shutil
    import tempfile
    from pathlib import Path

    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

    import horovod_ray

    hvd.init()
    seen: dict = {}

    def upload(checkpoint, destination):
        seen["upload_fn_from"] = sorted(os.listdir(checkpoint.path))
        shutil.copytree(checkpoint.path, destination)  # as Ray's users write it
        Path(destination, "uploaded_by").write_text("upload_fn")
        return Checkpoint(destination)

    steps = {
        1: {"checkpoint_upload_mode": CheckpointUploadMode.ASYNC},  # Ray's default: deleted
        2: {"checkpoint_upload_mode": CheckpointUploadMode.SYNC},  # kept
        3: {"delete_local_checkpoint_after_upload": True},
        4: {"checkpoint_upload_fn": upload, "checkpoint_upload_mode": CheckpointUploadMode.SYNC},
        5: {"checkpoint_upload_mode": CheckpointUploadMode.ASYNC},
        6: {"checkpoint_dir_name": f"epoch_6_rank_{hvd.rank()}"},  # still uploading below
        # Rank 0 writes it in the run's folder itself; the others report none.
        7: {"checkpoint_upload_mode": CheckpointUploadMode.NO_UPLOAD},
    }
    storage = horovod_ray.get_context().get_storage()
    folders = {}
    for step, options in steps.items():
        folders[step] = tempfile.mkdtemp() if step != 7 else f"{storage.run_path}/in_place"
        checkpoint = None
        if step != 7 or hvd.rank() == 0:
            os.makedirs(folders[step], exist_ok=True)
            Path(folders[step], "step").write_text(str(step))
            checkpoint = Checkpoint.from_directory(folders[step])
        horovod_ray.report({"step": step}, checkpoint=checkpoint, **options)
    # Rank 0 waits here for its uploads so far; the others wait for rank 0.
    reported = horovod_ray.get_all_reported_checkpoints() if hvd.rank() == 0 else None
    hvd.allreduce(torch.tensor(0.0), name="reported")
    reported = reported or horovod_ray.get_all_reported_checkpoints()
    seen["kept"] = [os.path.isdir(folders[step]) for step in steps]
    seen["reported"] = [
        (r.metrics["step"], Path(r.checkpoint.path, "step").read_text(), r.status.value)
        for r in reported
    ]
    seen["folders"] = [os.path.basename(r.checkpoint.path) for r in reported]
    seen["uploaded_by"] = Path(reported[3].checkpoint.path, "uploaded_by").read_text()
    return seen


def test_reports_options_have_ray_trains_meaning(ray_4cpu, tmp_path):
    rank0, rank1 = horovod_ray.run(
        _options, args=[str(tmp_path)], num_slots=2, storage_path=str(tmp_path), name="opts"
    )
    # Deleted once committed: ASYNC (Ray's default for it) and True; kept with SYNC
    # (and the default, for step 6), and where it was written with NO_UPLOAD.
    assert rank0["kept"] == [False, True, False, True, False, True, True]
    assert rank0["upload_fn_from"] == ["step"]
    assert rank0["reported"] == [(s, str(s), "COMMITTED") for s in range(1, 8)]
    assert rank0["folders"] == [f"checkpoint_00000{s}" for s in range(1, 6)] + [
        "epoch_6_rank_0", "in_place",
    ]  # fmt: skip
    assert sorted(os.listdir(tmp_path / "opts"))[-3:] == [
        "epoch_6_rank_0", "in_place", "metrics.json",
    ]  # fmt: skip
    assert rank0["uploaded_by"] == "upload_fn"
    assert rank1["reported"] == rank0["reported"]
    # Another rank's checkpoint is dropped: deleted at once where asked, as Ray's are.
    assert rank1["kept"] == rank0["kept"]


def _bad_upload(storage_path: str) -> None:
    import tempfile

    import horovod.torch as hvd
    from ray.train import Checkpoint

    import horovod_ray

    hvd.init()
    horovod_ray.report(
        {"step": 1},
        checkpoint=Checkpoint.from_directory(tempfile.mkdtemp()),
        checkpoint_upload_fn=lambda checkpoint, destination: checkpoint,  # not uploaded
    )


def test_an_upload_fn_that_does_not_upload_fails_the_job_naming_it(ray_4cpu, tmp_path):
    with pytest.raises(
        WorkerFailedError, match="checkpoint_upload_fn must upload to the destination"
    ):
        horovod_ray.run(_bad_upload, args=[str(tmp_path)], num_slots=2, storage_path=str(tmp_path))


@pytest.mark.unit
def test_a_folder_in_the_runs_storage_is_never_deleted(tmp_path):
    from ray.train import Checkpoint

    from horovod_ray.checkpoints import spec
    from horovod_ray.rank import report_options

    storage = spec.create(str(tmp_path), "run")
    inside = tmp_path / "run" / "checkpoint_000001"
    inside.mkdir(parents=True)
    for folder in (inside, tmp_path):  # in the run, or holding it
        with pytest.raises(ConfigError) as raised:
            report_options.outside_the_run(Checkpoint.from_directory(str(folder)), storage)
        assert raised.value.parameter == "delete_local_checkpoint_after_upload"
    report_options.outside_the_run(Checkpoint.from_directory(str(tmp_path / "run2")), storage)


@pytest.mark.unit
@pytest.mark.parametrize(
    "option",
    [
        {"checkpoint_dir_name": "epoch_1"},
        {"checkpoint_upload_mode": "SYNC"},
        {"delete_local_checkpoint_after_upload": False},
        {"checkpoint_upload_fn": lambda checkpoint, destination: checkpoint},
    ],
)
def test_a_tune_trial_refuses_the_upload_options_its_report_ignores(option, fresh_rank_session):
    from horovod_ray.rank import report

    report.use_tune_session(object())
    with pytest.raises(ConfigError) as raised:
        report.report({"step": 1}, **option)
    assert raised.value.parameter == next(iter(option))


@pytest.mark.unit
def test_a_consistency_mode_ray_does_not_have_is_refused():
    with pytest.raises(ConfigError) as raised:
        horovod_ray.get_all_reported_checkpoints("EVENTUAL")
    assert raised.value.parameter == "consistency_mode"


def _validated(storage_path: str) -> dict:
    import tempfile
    from pathlib import Path

    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint
    from ray.train.v2.api.validation_config import ValidationTaskConfig

    import horovod_ray

    hvd.init()
    requests = [
        True,  # the run's fn_kwargs: scale 2
        ValidationTaskConfig(fn_kwargs={"scale": 10}),
        ValidationTaskConfig(fn_kwargs={"fail": True}),
        ValidationTaskConfig(fn_kwargs={"sleep_s": 60}, timeout_s=1),
    ]
    for step, validation in enumerate(requests, 1):
        folder = tempfile.mkdtemp()
        Path(folder, "step").write_text(str(step))
        checkpoint = Checkpoint.from_directory(folder)
        horovod_ray.report({"step": step}, checkpoint=checkpoint, validation=validation)
    # VALIDATED (the default): rank 0 waits until each validation has ended.
    reported = horovod_ray.get_all_reported_checkpoints() if hvd.rank() == 0 else []
    hvd.allreduce(torch.tensor(0.0), name="validated")
    return {
        "pid": os.getpid(),
        "reported": [(r.status.value, r.metrics) for r in reported],
    }


def _validate(checkpoint, scale=1, fail=False, sleep_s=0):
    import time
    from pathlib import Path

    if fail:
        raise RuntimeError("no validation set")
    time.sleep(sleep_s)
    with checkpoint.as_directory() as folder:
        step = int(Path(folder, "step").read_text())
    return {"val_score": scale * step, "pid": os.getpid()}


def test_validation_runs_fn_in_a_ray_task_and_merges_its_metrics(ray_4cpu, tmp_path):
    from ray.train import ValidationConfig
    from ray.train.v2.api.validation_config import ValidationTaskConfig

    rank0, rank1 = horovod_ray.run(
        _validated,
        args=[str(tmp_path)],
        num_slots=2,
        storage_path=str(tmp_path),
        name="validated",
        validation_config=ValidationConfig(
            _validate, task_config=ValidationTaskConfig(fn_kwargs={"scale": 2})
        ),
    )
    statuses = [(status, metrics.get("val_score")) for status, metrics in rank0["reported"]]
    assert statuses == [
        ("VALIDATED", 2),
        ("VALIDATED", 20),
        ("VALIDATION_FAILED", None),
        ("VALIDATION_TIMEOUT", None),
    ]
    validated_in = {metrics["pid"] for _, metrics in rank0["reported"][:2]}
    assert not validated_in & {rank0["pid"], rank1["pid"], os.getpid()}  # Ray tasks
    result = horovod_ray.Result.from_path(str(tmp_path / "validated"))
    assert result.get_best_checkpoint("val_score", "max").path.endswith("checkpoint_000002")
    marker = (tmp_path / "validated" / "checkpoint_000003.json").read_text()
    assert "RuntimeError: no validation set" in marker


def _fails_while_validating(hold: str) -> None:
    import tempfile
    import time
    from pathlib import Path

    from ray.train import Checkpoint

    import horovod_ray

    folder = tempfile.mkdtemp()
    Path(folder, "step").write_text("1")
    horovod_ray.report({"step": 1}, checkpoint=Checkpoint.from_directory(folder), validation=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{hold}.pid") and time.monotonic() < deadline:
        time.sleep(0.1)  # until its validation is under way
    raise RuntimeError("failed while its checkpoint was validated")


def _held(checkpoint, hold):
    import time
    from pathlib import Path

    Path(f"{hold}.pid").write_text(str(os.getpid()))
    while os.path.exists(hold):
        time.sleep(0.1)
    return {"validated": True}


def test_a_failed_jobs_validation_is_cancelled_and_run_by_the_next_job(ray_4cpu, tmp_path):
    import json

    from ray.train import ValidationConfig
    from ray.train.v2.api.validation_config import ValidationTaskConfig

    from test.conftest import wait_until

    hold = tmp_path / "hold"
    hold.touch()
    job = {
        "num_slots": 1,
        "storage_path": str(tmp_path),
        "name": "requeued",
        "validation_config": ValidationConfig(
            _held, task_config=ValidationTaskConfig(fn_kwargs={"hold": str(hold)})
        ),
    }
    with pytest.raises(WorkerFailedError, match="while its checkpoint was validated"):
        horovod_ray.run(_fails_while_validating, args=[str(hold)], **job)
    marker = tmp_path / "requeued" / "checkpoint_000001.json"
    assert json.loads(marker.read_text())["validation"]["status"] == "PENDING_VALIDATION"
    task_pid = int((tmp_path / "hold.pid").read_text())

    def ended() -> bool:
        try:
            os.kill(task_pid, 0)
        except ProcessLookupError:
            return True
        return False

    assert wait_until(ended), "the failed job's validation task is still running"
    hold.unlink()
    horovod_ray.run(int, **job)  # a job that reports nothing: it runs the one left
    recorded = json.loads(marker.read_text())
    assert recorded["validation"]["status"] == "VALIDATED"
    assert recorded["metrics"] == {"step": 1, "validated": True}


def _every_rank_reports(storage_path: str, shared: str, resume: bool) -> dict:
    """Every rank reports the same folder with ASYNC (Ray's default: deleted once
    uploaded), as Ray's docs write the line: ``get_checkpoint()``'s (``resume``), or one
    that rank 0 wrote, which rank 0 reports a second after the others."""
    import time
    from pathlib import Path

    import horovod.torch as hvd
    import torch
    from ray.train import Checkpoint
    from ray.train.v2.api.report_config import CheckpointUploadMode

    import horovod_ray

    hvd.init()
    if resume:
        checkpoint = horovod_ray.get_checkpoint()
    else:
        if hvd.rank() == 0:
            Path(shared).mkdir()
            Path(shared, "weights").write_text("rank 0's")
        hvd.allreduce(torch.tensor(0.0), name="written")
        checkpoint = Checkpoint.from_directory(shared)
        if hvd.rank() == 0:
            time.sleep(1.0)
    raised = None
    try:
        horovod_ray.report(
            {"step": 1}, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.ASYNC
        )
    except horovod_ray.ConfigError as error:
        raised = error.parameter
    hvd.allreduce(torch.tensor(0.0), name="reported")  # a training step
    return {"raised": raised, "path": checkpoint.path}


def test_no_rank_deletes_a_folder_rank_0_reads(ray_4cpu, tmp_path):
    """The line that every rank runs: rank 1 deleted ``get_checkpoint()``'s folder, a
    committed checkpoint, at once (rank 0 refused it); and the folder that rank 0 wrote,
    while rank 0 was still to copy it."""
    shared = str(tmp_path / "shared")
    args = [str(tmp_path), shared]
    options = {"num_slots": 2, "storage_path": str(tmp_path), "name": "every"}
    first = horovod_ray.run(_every_rank_reports, args=[*args, False], **options)
    assert [rank["raised"] for rank in first] == [None, None]
    committed = tmp_path / "every" / "checkpoint_000001"
    assert (committed / "weights").read_text() == "rank 0's"
    assert not os.path.exists(shared)  # ASYNC: deleted once committed
    second = horovod_ray.run(_every_rank_reports, args=[*args, True], **options)
    # Refused on every rank, as Ray refuses; nothing deleted.
    assert [rank["raised"] for rank in second] == ["delete_local_checkpoint_after_upload"] * 2
    assert second[1]["path"] == str(committed)
    assert (committed / "weights").read_text() == "rank 0's"
