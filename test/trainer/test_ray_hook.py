"""Ray Train v2's functions answering through horovod_ray (``trainer/ray_hook``), without
Ray: Ray's private hook held to what this package implements (these fail the day Ray
changes it), and each of Ray's functions reaching horovod_ray's in a local run."""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import pytest
import ray.train
from ray.train import Checkpoint
from ray.train.v2._internal.execution import train_fn_utils
from ray.train.v2.api.context import TrainContext

import horovod_ray
from horovod_ray.trainer import ray_hook

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def test_rays_hook_asks_what_this_package_implements():
    assert train_fn_utils.TrainFnUtils.__abstractmethods__ == ray_hook.FN_UTILS_METHODS
    assert TrainContext.__abstractmethods__ == ray_hook.CONTEXT_METHODS
    assert not ray_hook.RankFnUtils.__abstractmethods__  # each one implemented
    assert not ray_hook.RankContext.__abstractmethods__


def test_ray_train_reports_options_are_horovod_rays():
    rays = set(inspect.signature(ray.train.report).parameters)
    ours = set(inspect.signature(horovod_ray.report).parameters)
    assert rays <= ours, rays - ours


def _uses_ray_train() -> dict:
    with ray_hook.installed():
        before = ray.train.get_checkpoint()
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step").write_text("1")
            ray.train.report({"step": 1}, checkpoint=Checkpoint.from_directory(folder))
        context = ray.train.get_context()
        reported = ray.train.get_all_reported_checkpoints()
        answers = {
            "before": before,
            "rank": (context.get_world_rank(), context.get_world_size()),
            "local": (context.get_local_rank(), context.get_local_world_size()),
            "name": context.get_experiment_name(),
            "reported": [r.metrics["step"] for r in reported],
            "preempted": ray.train.get_preemption_info(),
        }
    with pytest.raises(RuntimeError, match="outside"):  # uninstalled: Ray's refusal again
        ray.train.report({"step": 2})
    return answers


def test_rays_functions_reach_horovod_rays_on_a_rank(tmp_path, fresh_rank_session):
    settings = horovod_ray.RayExecutor.create_settings(name="hooked", storage_path=str(tmp_path))
    (answers,) = horovod_ray.run(
        _uses_ray_train,
        local=True,
        settings=settings,
    )
    assert answers == {
        "before": None,
        "rank": (0, 1),
        "local": (0, 1),
        "name": "hooked",
        "reported": [1],
        "preempted": None,
    }
    assert horovod_ray.Result.from_path(str(tmp_path / "hooked")).metrics == {"step": 1}


@pytest.mark.parametrize(
    "loop, takes",
    [(lambda: None, False), (lambda config: None, True), (lambda config, x=1: None, True)],
)
def test_the_loop_takes_config_as_ray_calls_it(loop, takes):
    assert ray_hook.takes_config(loop) is takes


def test_a_trials_config_is_merged_into_the_loops_as_rays_trainers_merge_it():
    base = {"lr": 0.1, "model": {"width": 8, "depth": 2}, "epochs": 3}
    tuned = {"lr": 0.5, "model": {"depth": 4}, "seed": 1}
    assert ray_hook.merged(base, tuned) == {
        "lr": 0.5, "model": {"width": 8, "depth": 4}, "epochs": 3, "seed": 1
    }  # fmt: skip
    assert base["model"] == {"width": 8, "depth": 2}  # the trainer's own left as it was


class _Trial:
    """What a Tune trial's session is to a rank's report (tune/session.TrialSession)."""

    loaded_checkpoint = None

    def __init__(self) -> None:
        self.reports: list = []

    def report(self, metrics, *, checkpoint=None):
        self.reports.append((metrics, checkpoint))


def test_rays_report_in_a_tuners_trial_reaches_the_trial_without_upload_options(
    fresh_rank_session,
):
    from horovod_ray.rank import report

    trial = _Trial()
    report.use_tune_session(trial)
    try:
        with ray_hook.installed(), tempfile.TemporaryDirectory() as folder:
            # Ray's report fills in its SYNC mode, which Tune's own report is.
            ray.train.report({"step": 1}, checkpoint=Checkpoint.from_directory(folder))
            with pytest.raises(horovod_ray.ConfigError, match="checkpoint_dir_name"):
                ray.train.report({"step": 2}, checkpoint_dir_name="named")
    finally:
        report.use_tune_session(None)
    ((metrics, checkpoint),) = trial.reports
    assert metrics == {"step": 1} and checkpoint.path == folder
