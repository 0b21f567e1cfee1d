"""horovod's Keras API on the installed Keras, on 2 real ranks.

On the default stack that is Keras 3, where stock horovod 0.28.1 fails each of these
(patches/horovod-0.28.1-keras3-*.patch; without patches/horovod-0.28.1-tf-cpu-without-xla.patch
horovod does not even build against TensorFlow 2.21). The 2023 line (``make test-2023``)
runs the same tests on Keras 2, where the saved-model test needs
patches/horovod-0.28.1-keras2-save-format.patch. Every rank trains on data of its own
(test/keras_training.py).
"""

from __future__ import annotations

from importlib.metadata import version

import numpy as np
import pytest

from horovod_ray import RayExecutor
from horovod_ray.job.lifecycle import ExecutorState
from test import keras_training
from test.conftest import same_on_every_rank, start_local_ray

# Also on the 2023 line: horovod's Keras API on Keras 2.
pytestmark = [pytest.mark.timeout(300), pytest.mark.line_2023]

KERAS3 = int(version("keras").split(".")[0]) >= 3


@pytest.fixture(scope="module")
def _job():
    """One 2-rank job for the module, started again after a test whose ranks failed."""
    start_local_ray(4)
    holder: dict[str, RayExecutor] = {}
    yield holder
    holder["executor"].stop()


@pytest.fixture
def executor(_job) -> RayExecutor:
    current = _job.get("executor")
    if current is None or current.state is not ExecutorState.RUNNING:
        if current is not None:
            current.stop()
        # horovod's tensorflow2_mnist_ray example's form (horovod.ray 0.20-0.22 names).
        settings = RayExecutor.create_settings(timeout_s=120)
        with pytest.warns(DeprecationWarning, match="older name"):
            current = RayExecutor(settings, num_hosts=1, num_slots=2, cpus_per_slot=1)
        current.start()
        _job["executor"] = current
    return current


@pytest.mark.parametrize(
    ("optimizer", "passes", "fp16"),
    [("SGD", 1, False), ("Adam", 1, False), ("SGD", 2, False), ("SGD", 1, True)],
)
def test_distributed_optimizer_averages_the_ranks_gradients(executor, optimizer, passes, fp16):
    results = executor.run(keras_training.fit_distributed, args=(optimizer, passes, fp16))
    weights = same_on_every_rank(results, "weights")
    # One update; the optimizer's step counts the batches (as on Keras 2).
    assert same_on_every_rank(results, "iterations") == passes
    if optimizer == "SGD":
        # Exactly plain TensorFlow's step along the ranks' mean gradient (summed over
        # the passes): the gradients were averaged, not each rank's own applied.
        expected = results[0]["expected_sgd"]
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=2e-3 if fp16 else 1e-5, atol=1e-6)
    else:
        # Adam's first step moves every weight by the learning rate against its gradient.
        assert np.allclose(np.abs(np.concatenate(weights)), 0.1, atol=1e-4)


def test_callbacks_broadcast_average_and_schedule(executor):
    results = executor.run(keras_training.fit_with_callbacks, args=(5,))
    # Ranks started from different weights and saw different data.
    same_on_every_rank(results, "weights")
    loss = same_on_every_rank(results, "loss")  # averaged over the ranks
    assert loss[-1] < 0.7 * loss[0]
    # Warm-up from lr / size over 2 epochs (the rate at each epoch's last batch), then
    # the schedule: x1 at epoch 3, x0.5 at epoch 4.
    lr = same_on_every_rank(results, "lr")
    np.testing.assert_allclose(lr, [0.0375, 0.05, 0.05, 0.05, 0.025], rtol=1e-6)


def test_mixed_precision_scales_the_averaged_gradients(executor):
    results = executor.run(keras_training.fit_mixed_precision)
    same_on_every_rank(results, "weights")
    loss = results[0]["loss"]
    assert loss[-1] < loss[0]
    if KERAS3:  # the loss scaling inside the averaging (Keras 2's compile puts it outside)
        assert "LossScaleOptimizer" in results[0]["optimizer"]


def test_unsupported_uses_get_a_clear_error(executor):
    momentum, legacy, accumulation = executor.run(keras_training.clear_errors)[0]
    assert "momentum_correction=False" in momentum and "SGD" in momentum
    if KERAS3:
        assert "legacy_opts=False" in legacy
        assert "backward_passes_per_step=2" in accumulation


@pytest.mark.skipif(not KERAS3, reason='Keras 2 has no jit_compile="auto"')
def test_xla_compiled_steps_lack_horovods_ops_and_auto_leaves_xla_off_on_cpus(executor):
    """docs/keras3.rst's advice: XLA has no kernel for horovod's allreduce, so
    ``jit_compile=True`` fails at the first step; ``"auto"`` (the default) turns XLA off
    where TensorFlow sees only CPUs, as here, and on where it sees a GPU (Keras 3's
    ``_resolve_auto_jit_compile``), hence ``jit_compile=False`` on GPUs."""
    found = executor.run(keras_training.jit_compile_modes)[0]
    kind, message = found["True"]
    assert kind == "InvalidArgumentError"
    assert "No registered 'HorovodAllreduce' OpKernel for XLA_CPU_JIT" in message
    assert found["auto"] == ("trained", False)


def test_gradient_tape_broadcast_variables_and_collectives(executor):
    results = executor.run(keras_training.tape_and_collectives)
    same_on_every_rank(results, "after_broadcast")  # rank 0's random weights everywhere
    same_on_every_rank(results, "grads")  # averaged over different data
    assert same_on_every_rank(results, "allreduce") == [3.0, 3.0]
    assert same_on_every_rank(results, "allgather") == [0, 1]
    assert same_on_every_rank(results, "broadcast") == 11
    assert [r["alltoall"] for r in results] == [[0, 10], [1, 11]]
    assert same_on_every_rank(results, "grouped") == [[3.0, 3.0], [6.0, 6.0]]


def test_elastic_states_commit_restore_and_sync(executor):
    results = executor.run(keras_training.elastic_state)
    for kind in ("KerasState", "TensorFlowKerasState"):
        states = [r[kind] for r in results]
        synced = same_on_every_rank(states, "synced")  # model and optimizer
        assert len(synced[1]) > 2  # the optimizer's slots, not only its step and rate
        assert all(s["moved"] != s["synced"][0] for s in states)
        assert same_on_every_rank(states, "restored") == synced
        assert same_on_every_rank(states, "epoch") == 0  # rank 0's, the committed one


def test_saved_model_loads_with_horovod_and_without(executor, tmp_path):
    results = executor.run(keras_training.save_and_load, args=(str(tmp_path),))
    assert all(r["same_weights"] for r in results)
    assert same_on_every_rank(results, "loaded_optimizer") == "Adam"
    assert all(r["loaded_is_distributed"] for r in results)
    assert all(r["loss_after"] < r["loss_before"] for r in results)
    same_on_every_rank(results, "weights_after")  # trained on together after loading
    assert same_on_every_rank(results, "plain_optimizer") == "Adam"
    assert not any(r["plain_is_distributed"] for r in results)
    if KERAS3:  # a model saved with a plain optimizer comes back distributed too
        assert all(r["from_plain_is_distributed"] for r in results)
        same_on_every_rank(results, "from_plain_weights")
