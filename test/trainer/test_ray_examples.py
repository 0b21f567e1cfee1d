"""Ray's own HorovodTrainer examples, as Ray 2.60's wheel ships them
(``ray/train/examples/horovod``), run on horovod_ray with one line changed: the trainer's
import. The MNIST ones also read their data from ``mnist_standin`` instead of torchvision
(which does not import beside this machine's CPU torch, and would download). The source
is read from the installed Ray, not copied: a Ray whose examples change those lines fails
here."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import ray.train.constants
import ray.train.examples.horovod

from test.trainer.test_trainer import ray_data  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(240)

_TRAINER = (
    "from ray.train.horovod import HorovodTrainer",
    "from horovod_ray import HorovodTrainer",
)
_DATA = (
    "from torchvision import datasets, transforms",
    "from test.trainer.mnist_standin import datasets, transforms",
)


def ray_example(name: str, *changes: tuple[str, str]) -> types.ModuleType:
    """Ray's example ``name`` with each ``(line, instead)`` changed, as a module."""
    path = Path(ray.train.examples.horovod.__file__).parent / name
    source = path.read_text()
    for line, instead in changes:
        assert source.count(line) == 1, f"Ray's {name} no longer has {line!r} once"
        source = source.replace(line, instead)
    module = types.ModuleType(f"ray_example_{path.stem}")  # not importable: pickled by value
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


@pytest.fixture
def storage(tmp_path, monkeypatch):
    """Ray's default storage (the examples give none) in the test's folder; the lock file
    the MNIST examples take in the home folder (their ranks run on this machine) removed
    after, unless it was there before."""
    monkeypatch.setattr(ray.train.constants, "DEFAULT_STORAGE_PATH", str(tmp_path))
    lock = Path("~/.horovod_lock").expanduser()
    there = lock.exists()
    yield tmp_path
    if not there:
        lock.unlink(missing_ok=True)


_KWARGS = {"data_dir": None, "seed": 42, "use_cuda": False, "batch_size": 64}
_KWARGS |= {"use_adasum": False, "lr": 0.01, "momentum": 0.5, "num_epochs": 2}
_KWARGS |= {"log_interval": 100}


def test_rays_horovod_example(ray_data, ray_4cpu, no_leaks, storage, capsys):  # noqa: F811
    example = ray_example("horovod_example.py", _TRAINER, _DATA)
    example.main(num_workers=2, use_gpu=False, kwargs=_KWARGS)
    # main() prints the result's metrics: the last epoch's loss.
    printed = re.search(r"^\{'loss': ([0-9.]+)\}$", capsys.readouterr().out, re.MULTILINE)
    assert printed and 0 < float(printed.group(1)) < 10


def test_rays_horovod_pytorch_example(ray_data, ray_4cpu, no_leaks, storage, capsys):  # noqa: F811
    example = ray_example("horovod_pytorch_example.py", _TRAINER, _DATA)
    example.main(num_workers=2, use_gpu=False, kwargs=_KWARGS)
    # main() prints Ray's Result; a checkpoint per epoch is in the run's folder.
    out = capsys.readouterr().out
    assert out.startswith("Result(") and "'loss':" in out
    (run,) = storage.iterdir()
    models = sorted(path.relative_to(run) for path in run.rglob("model.pt"))
    assert len(models) == 2, models


def test_rays_horovod_tune_example(ray_data, ray_4cpu, no_leaks, storage, capsys):  # noqa: F811
    example = ray_example("horovod_tune_example.py", _TRAINER)
    example.tune_horovod(num_workers=2, num_samples=2, use_gpu=False)
    assert "Best hyperparameters found were:  {'train_loop_config': {'lr':" in (
        capsys.readouterr().out
    )
    (experiment,) = storage.iterdir()
    trials = [path for path in experiment.iterdir() if path.name.startswith("HorovodTrainer_")]
    assert len(trials) == 2
    for trial in trials:  # each ran its 5 steps, without an error
        assert not list(trial.glob("error.*"))
        last = json.loads((trial / "result.json").read_text().splitlines()[-1])
        assert last["training_iteration"] == 5
