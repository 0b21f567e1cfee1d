"""An elastic Horovod job on Ray: Keras digits that survives lost ranks and grows back.

The training function is horovod's elastic API, unchanged: a ``TensorFlowKerasState``
holding the model, the optimizer and the position (epoch, batch), committed after every
batch, and ``hvd.elastic.run`` around the loop. When a rank or a node is lost, the others
roll back to the last commit and go on with fewer ranks (no fewer than ``--min-workers``);
when Ray has room again (a node joins, the autoscaler adds one), new ranks join at a commit,
up to ``--max-workers``. The driver prints each change of membership.

    python examples/elastic_tensorflow2_digits.py --min-workers 2 --max-workers 4
    python examples/elastic_tensorflow2_digits.py --address auto --min-workers 2 --max-workers 8
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

import horovod_ray

SEED = 1234


def train(epochs: int, learning_rate: float, batch_size: int) -> dict:
    """One rank's elastic training; returns the final world's view of held-out accuracy."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    tf.get_logger().setLevel("ERROR")
    hvd.init()
    tf.keras.utils.set_random_seed(SEED)
    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model(x_train[:1])  # builds the weights, so the state can hold them
    optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < epochs:
            # The shard depends on the world's size, which may have changed at a reset.
            x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
            batches = len(x_shard) // batch_size
            while state.batch < batches:
                start = state.batch * batch_size
                loss = step(
                    x_shard[start : start + batch_size], y_shard[start : start + batch_size]
                )
                state.batch += 1
                state.commit()
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch + 1:>2}/{epochs}  loss {float(loss):.4f}  "
                    f"ranks {hvd.size()}",
                    flush=True,
                )
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    loop(state)
    accuracy = np.mean(np.argmax(model(x_test).numpy(), axis=1) == y_test)
    return {"rank": hvd.rank(), "size": hvd.size(), "test_accuracy": float(accuracy)}


class ShowChanges(horovod_ray.Callback):
    """Prints each change of membership (a plain function would get only log() dicts)."""

    def on_membership(self, change: dict) -> None:
        print(
            f"membership: {change['size_before']} -> {change['size_after']} ranks "
            f"(+{len(change['nodes_added'])} / -{len(change['nodes_removed'])} nodes)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (e.g. auto; default: RAY_ADDRESS, else a local Ray)",
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by local workers
    if args.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=args.address)  # None: the cluster in RAY_ADDRESS (a Ray Job's)
    else:
        ray.init(num_cpus=max(args.max_workers, os.cpu_count() or 1), include_dashboard=False)
    results = horovod_ray.run(
        train,
        kwargs={
            "epochs": args.epochs,
            "learning_rate": args.learning_rate,
            "batch_size": args.batch_size,
        },
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        callbacks=[ShowChanges()],
    )
    print(f"final world: {len(results)} ranks, held-out accuracy {results[0]['test_accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
