"""A plain horovodrun script: Keras digits on Horovod, nothing of horovod_ray in it.

It runs the same under horovodrun and under horovod-ray's command line::

    horovodrun --gloo -np 2 python examples/horovodrun_tensorflow2_digits.py
    horovod-ray run -np 2 python examples/horovodrun_tensorflow2_digits.py

Every rank trains on its own shard of scikit-learn's bundled digits (no download); rank 0
prints each epoch and every rank prints its held-out accuracy at the end.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow.keras as hvd  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

SEED = 1234


class PrintEpoch(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1:>2}  loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    tf.get_logger().setLevel("ERROR")
    hvd.init()
    tf.keras.utils.set_random_seed(SEED + hvd.rank())
    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.Adam(learning_rate=args.learning_rate * hvd.size())
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(
        x_shard,
        y_shard,
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=0,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            PrintEpoch(),
        ],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"rank {hvd.rank()} of {hvd.size()}: held-out accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
