"""Tunes the learning rate of the digits model with Ray Tune; every trial is a Horovod job.

Each trial trains the Keras digits classifier on 2 Horovod ranks (horovod_ray.tune), reports
held-out loss and accuracy after every epoch with ray.tune.report, and checkpoints its
weights. ASHA stops the weak trials early. Prints the results table and the best config.

    python examples/tune_tensorflow2_digits.py --num-samples 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from horovod_ray.tune import DistributedTrainableCreator

SEED = 1234


def train(config: dict) -> None:
    """One rank of one trial."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd_tf
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
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Input(shape=(64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(learning_rate=config["lr"] * hvd.size(), momentum=0.9)
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    start_epoch = 0
    checkpoint = tune.get_checkpoint()  # set on every rank when the trial resumes
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            model.load_weights(os.path.join(directory, "model.weights.h5"))
            with open(os.path.join(directory, "epoch.txt")) as handle:
                start_epoch = int(handle.read())
    else:
        model(x_shard[:1])  # build the weights so that rank 0's can be broadcast
        hvd_tf.broadcast_variables(model.variables, root_rank=0)

    for epoch in range(start_epoch, config["epochs"]):
        model.fit(x_shard, y_shard, batch_size=32, epochs=1, verbose=0)
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
        with tempfile.TemporaryDirectory() as directory:
            if hvd.rank() == 0:
                model.save_weights(os.path.join(directory, "model.weights.h5"))
                with open(os.path.join(directory, "epoch.txt"), "w") as handle:
                    handle.write(str(epoch + 1))
            tune.report(
                {"loss": loss, "accuracy": accuracy, "epoch": epoch + 1},
                checkpoint=tune.Checkpoint.from_directory(directory) if hvd.rank() == 0 else None,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2, help="Horovod ranks per trial")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (e.g. auto; default: RAY_ADDRESS, else a local Ray)",
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=args.address)  # None: the cluster in RAY_ADDRESS (a Ray Job's)
    else:
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False)

    trainable = DistributedTrainableCreator(train, num_hosts=1, num_slots=args.num_workers)
    tuner = tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(1e-3, 1e-1), "epochs": args.epochs},
        tune_config=tune.TuneConfig(
            num_samples=args.num_samples,
            metric="loss",
            mode="min",
            scheduler=ASHAScheduler(max_t=args.epochs, grace_period=2),
            reuse_actors=True,  # a finished trial's warm ranks run the next trial
        ),
        run_config=tune.RunConfig(
            name="horovod_ray_tune_digits",
            storage_path=os.path.abspath(os.path.join("build", "tune")),
            verbose=0,
        ),
    )
    results = tuner.fit()
    table = results.get_dataframe().rename(columns={"config/lr": "lr"})
    table = table[["trial_id", "lr", "training_iteration", "loss", "accuracy"]]
    print(table.sort_values("loss").to_string(index=False))
    best = results.get_best_result()
    print(
        f"best config: lr={best.config['lr']:.5f}  loss {best.metrics['loss']:.4f}  "
        f"accuracy {best.metrics['accuracy']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
