"""B4: Tune turnaround, the wall time of one ``Tuner.fit()`` of the mode's trials.

Each trial runs 2 workers that import TensorFlow, join Horovod, do one allreduce and report
once: horovod_ray's ``DistributedTrainableCreator`` against Ray Train's ``HorovodTrainer``
inside a ``Tuner``, both with the same ``TuneConfig``.
"""

from __future__ import annotations

import time

from bench.cases import workloads
from bench.harness.common import NUM_CPUS, Mode, alternate, ratio, summary


def b4(mode: Mode, storage: str) -> dict:
    print(f"B4 Tune turnaround, {mode.b4_trials} trials x 2 workers on {NUM_CPUS} CPUs")
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.horovod import HorovodTrainer

    from horovod_ray.tune import DistributedTrainableCreator

    # The same Tune settings for both; Tune hands a finished trial's actor to the next.
    tune_config = tune.TuneConfig(num_samples=mode.b4_trials, reuse_actors=True)

    def ours() -> float:
        start = time.perf_counter()
        results = tune.Tuner(
            DistributedTrainableCreator(workloads.one_report_trial, num_hosts=1, num_slots=2),
            tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        ).fit()
        assert results.num_errors == 0, results.errors
        return time.perf_counter() - start

    def trainer() -> float:
        def loop(config):
            from ray import train

            train.report({"at": workloads.first_allreduce()})

        start = time.perf_counter()
        results = tune.Tuner(
            HorovodTrainer(
                loop,
                scaling_config=ScalingConfig(num_workers=2, trainer_resources={"CPU": 0}),
                run_config=RunConfig(storage_path=storage),
            ),
            tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        ).fit()
        assert results.num_errors == 0, results.errors
        return time.perf_counter() - start

    runs = alternate({"horovod_ray": ours, "HorovodTrainer": trainer}, mode.b4_reps)
    return {
        "b4_tune_s": {name: summary(values) for name, values in runs.items()},
        "b4_ratio": ratio(runs["horovod_ray"], runs["HorovodTrainer"]),
    }
