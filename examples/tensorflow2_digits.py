"""Trains a Keras digit classifier with Horovod on Ray, through horovod_ray.run.

The data is scikit-learn's bundled digits set (1,797 8x8 images, no download). Every rank
trains on its own shard of the training split; Horovod averages the gradients, rank 0's
initial weights are broadcast to all, and rank 0 reports each epoch to the driver, which
prints it as training goes. At the end every rank scores the held-out split.

    python examples/tensorflow2_digits.py --num-workers 2
    python examples/tensorflow2_digits.py --address auto --num-hosts 2 --num-workers 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ray

import horovod_ray

SEED = 1234


def train(epochs: int, learning_rate: float, batch_size: int) -> dict:
    """One rank's training; returns its view of the final held-out metrics."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    tf.get_logger().setLevel("ERROR")
    hvd.init()
    tf.keras.utils.set_random_seed(SEED + hvd.rank())

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    # Each rank sees a disjoint shard; together they cover the training split once.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    # The effective batch is size x batch_size, so the step size scales with it.
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.Adam(learning_rate=learning_rate * hvd.size())
    )
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )

    class ReportEpoch(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            # Averaged over ranks by MetricAverageCallback, which runs first.
            horovod_ray.log(
                {
                    "epoch": epoch + 1,
                    "epochs": epochs,
                    "loss": float(logs["loss"]),
                    "accuracy": float(logs["accuracy"]),
                }
            )

    model.fit(
        x_shard,
        y_shard,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            ReportEpoch(),
        ],
    )
    test_loss, test_accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "train_examples": len(x_shard),
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
    }


def _show_progress(metrics: dict) -> None:
    print(
        f"epoch {metrics['epoch']:>2}/{metrics['epochs']}  loss {metrics['loss']:.4f}  "
        f"accuracy {metrics['accuracy']:.4f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", type=int, default=2, help="total Horovod ranks")
    parser.add_argument("--num-hosts", type=int, default=1, help="nodes to spread over")
    parser.add_argument("--address", default=None, help="Ray cluster address (e.g. auto)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.num_hosts < 1 or args.num_workers % args.num_hosts:
        parser.error("--num-workers must be a positive multiple of --num-hosts")

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by local workers
    if args.address:
        ray.init(address=args.address)
    # Otherwise run() starts a local Ray sized for the job, its workers at normal priority.

    started = time.perf_counter()
    results = horovod_ray.run(
        train,
        kwargs={
            "epochs": args.epochs,
            "learning_rate": args.learning_rate,
            "batch_size": args.batch_size,
        },
        num_hosts=args.num_hosts,
        num_slots=args.num_workers // args.num_hosts,
        callbacks=[_show_progress],
    )
    elapsed = time.perf_counter() - started
    for result in results:
        print(
            f"rank {result['rank']}: trained on {result['train_examples']} examples, "
            f"held-out accuracy {result['test_accuracy']:.4f}"
        )
    print(
        f"final held-out accuracy: {results[0]['test_accuracy']:.4f} "
        f"({len(results)} workers, {elapsed:.1f}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
