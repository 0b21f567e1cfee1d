"""Keras training that runs on every rank, for test_keras.py: horovod's Keras API on the
Keras of the installed TensorFlow (Keras 3 on the default stack, Keras 2 on the 2023 line).

Every rank trains a linear model on data of its own (``_data(rank)``). Each function
returns plain numbers, and the test compares the ranks with each other and with what
plain TensorFlow computes from both ranks' data.
"""

from __future__ import annotations

import os

import numpy as np

FEATURES = 4


def _data(rank: int, rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s data: the same linear target, seen through different samples."""
    rng = np.random.default_rng(100 + rank)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 3.0, 0.5], "float32") + 0.3 * rank)[:, None]
    return x, y.astype("float32")


def _model(seed: int | None = None):
    """A linear model; zeros on every rank, or random from ``seed``."""
    import keras

    init = "zeros" if seed is None else keras.initializers.RandomNormal(seed=seed)
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer=init)]
    )


def _weights(model) -> list[list[float]]:
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]


def _gradients_at_zero(x: np.ndarray, y: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Plain TensorFlow: the summed mean-squared-error gradients of the zero model over
    ``x``'s batches (kernel, then bias)."""
    import tensorflow as tf

    kernel = tf.Variable(tf.zeros((FEATURES, 1)))
    bias = tf.Variable(tf.zeros((1,)))
    total = [np.zeros((FEATURES, 1), "float32"), np.zeros((1,), "float32")]
    for start in range(0, len(x), batch_size):
        with tf.GradientTape() as tape:
            predicted = x[start : start + batch_size] @ kernel + bias
            loss = tf.reduce_mean(tf.square(predicted - y[start : start + batch_size]))
        for i, grad in enumerate(tape.gradient(loss, [kernel, bias])):
            total[i] += grad.numpy()
    return total


def fit_distributed(optimizer: str, backward_passes_per_step: int = 1, fp16: bool = False) -> dict:
    """One SGD/Adam step (``backward_passes_per_step`` batches) through ``model.fit`` with
    ``hvd.DistributedOptimizer``; returns the weights and what plain TensorFlow expects
    for SGD: the step along the gradients summed over the batches, averaged over ranks."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    make = {"SGD": keras.optimizers.SGD, "Adam": keras.optimizers.Adam}[optimizer]
    opt = hvd.DistributedOptimizer(
        make(learning_rate=0.1),
        backward_passes_per_step=backward_passes_per_step,
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none,
    )
    model = _model()
    model.compile(optimizer=opt, loss="mse")
    batch = len(x) // backward_passes_per_step
    # The broadcast after the first batch must leave each rank's own gradient sums alone.
    broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[broadcast])
    ranks = [_gradients_at_zero(*_data(r), batch) for r in range(hvd.size())]
    expected = [-0.1 * np.mean([g[i] for g in ranks], axis=0).ravel() for i in range(2)]
    return {
        "weights": _weights(model),
        "expected_sgd": [e.tolist() for e in expected],
        "iterations": int(np.asarray(model.optimizer.iterations)),
    }


def fit_mixed_precision() -> dict:
    """Under the mixed_float16 policy: the loss scaling sees the averaged gradients, so
    every rank takes (or skips) the same steps."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(seed=hvd.rank())
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
        broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[broadcast])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return {
        "weights": _weights(model),
        "loss": [float(v) for v in history.history["loss"]],
        "optimizer": [c.__name__ for c in type(model.optimizer).__mro__],
    }


def fit_with_callbacks(epochs: int = 4) -> dict:
    """Ranks start from different weights; the callbacks broadcast rank 0's, average the
    metrics, warm the learning rate up over 2 epochs and halve it from epoch 3 on."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    model = _model(seed=hvd.rank())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.05, multiplier=0.5, start_epoch=3),
    ]
    history = model.fit(x, y, batch_size=16, epochs=epochs, callbacks=callbacks, verbose=0)
    return {
        "weights": _weights(model),
        "loss": [float(v) for v in history.history["loss"]],
        "lr": [float(v) for v in history.history["lr"]],
    }


def clear_errors() -> tuple[str, str, str]:
    """What cannot work says so at the call, naming what to do instead: the learning-rate
    callbacks' momentum correction on a momentum that Keras compiles into the step, and
    ``load_model(legacy_opts=True)`` where Keras has no legacy optimizers (Keras 3)."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    model = _model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse"
    )
    warmup = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1)
    messages = []
    try:
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[warmup], verbose=0)
    except ValueError as err:
        messages.append(str(err))
    try:
        hvd.load_model("missing.keras", legacy_opts=True)
    except (ValueError, OSError) as err:
        messages.append(str(err))
    try:  # Keras 3's own accumulation would average every micro-batch over the ranks
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    except (ValueError, TypeError) as err:  # TypeError: Keras 2 has no such argument
        messages.append(str(err))
    return messages[0], messages[1], messages[2]


def jit_compile_modes() -> dict:
    """``compile(jit_compile=True)`` then ``"auto"``: what Keras 3 does with horovod's
    allreduce in the training step, on this machine (docs/keras3.rst, docs/gpus.rst)."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    found = {}
    for mode in (True, "auto"):
        model = _model()
        model.compile(
            optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
            loss="mse",
            jit_compile=mode,
        )
        try:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            found[str(mode)] = ("trained", model.jit_compile)
        except Exception as err:  # noqa: BLE001 - what XLA raises is the finding
            found[str(mode)] = (type(err).__name__, str(err))
    return found


def tape_and_collectives() -> dict:
    """``hvd.DistributedGradientTape`` and ``hvd.broadcast_variables`` on a Keras model's
    variables, and the tensor collectives."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = _model(seed=rank)
    hvd.broadcast_variables(model.variables, root_rank=0)
    after_broadcast = _weights(model)
    x, y = _data(rank)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    local = tf.constant([float(rank + 1)] * 2)
    return {
        "after_broadcast": after_broadcast,
        "grads": [g.numpy().ravel().tolist() for g in grads],
        "allreduce": hvd.allreduce(local, op=hvd.Sum).numpy().tolist(),
        "allgather": hvd.allgather(tf.constant([rank])).numpy().tolist(),
        "broadcast": hvd.broadcast(tf.constant(rank + 10), root_rank=1).numpy().tolist(),
        "alltoall": hvd.alltoall(tf.constant([rank * 10 + peer for peer in range(size)]))
        .numpy()
        .tolist(),
        "grouped": [
            t.numpy().tolist() for t in hvd.grouped_allreduce([local, local * 2], op=hvd.Sum)
        ],
    }


def elastic_state() -> dict:
    """``KerasState`` and ``TensorFlowKerasState``: commit, restore and sync a Keras model
    and its (built) optimizer."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    rank = hvd.rank()
    out = {}
    for kind in ("KerasState", "TensorFlowKerasState"):
        model = _model(seed=rank)
        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.1))
        model.compile(optimizer=opt, loss="mse")
        x, y = _data(rank)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        state_class = getattr(hvd.elastic, kind)
        state = state_class(model, epoch=rank)
        state.sync()  # rank 0's model, optimizer and epoch everywhere
        synced = _weights(model), [np.asarray(v).ravel().tolist() for v in opt.variables]
        state.commit()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        state.epoch = 99
        moved = _weights(model)
        state.restore()
        restored = _weights(model), [np.asarray(v).ravel().tolist() for v in opt.variables]
        out[kind] = {
            "synced": synced,
            "moved": moved,
            "restored": restored,
            "epoch": state.epoch,
        }
    return out


def save_and_load(folder: str) -> dict:
    """A model trained with the distributed optimizer, saved as ``.keras`` by rank 0, then
    loaded with ``hvd.load_model`` (optimizer distributed, training goes on) and with plain
    Keras (the base optimizer)."""
    import horovod.tensorflow.keras as hvd
    import keras

    hvd.init()
    x, y = _data(hvd.rank())
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = os.path.join(folder, "model.keras")
    if hvd.rank() == 0:
        model.save(path)
    hvd.allreduce(np.zeros(1), name="saved")  # a barrier: the file is there for every rank
    loaded = hvd.load_model(path)
    same = [
        np.allclose(a, b) for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True)
    ]
    before = loaded.evaluate(x, y, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=2, verbose=0)
    plain = keras.models.load_model(path)
    # Saved with a plain optimizer: hvd.load_model still makes it distributed.
    undistributed = _model()
    undistributed.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    undistributed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    plain_path = os.path.join(folder, "plain.keras")
    if hvd.rank() == 0:
        undistributed.save(plain_path)
    hvd.allreduce(np.zeros(1), name="saved_plain")
    from_plain = hvd.load_model(plain_path)
    from_plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return {
        "from_plain_is_distributed": hasattr(from_plain.optimizer, "register_local_var"),
        "from_plain_weights": _weights(from_plain),
        "same_weights": all(same),
        "loaded_optimizer": type(loaded.optimizer).__name__,
        "loaded_is_distributed": hasattr(loaded.optimizer, "register_local_var"),
        "loss_before": float(before),
        "loss_after": float(loaded.evaluate(x, y, verbose=0)),
        "weights_after": _weights(loaded),
        "plain_optimizer": type(plain.optimizer).__name__,
        "plain_is_distributed": hasattr(plain.optimizer, "register_local_var"),
    }
