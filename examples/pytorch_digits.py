"""Trains a PyTorch digit classifier with Horovod on Ray, through horovod_ray.run.

The same task as tensorflow2_digits.py: scikit-learn's bundled digits set (1,797 8x8
images, no download), every rank on its own shard of the training split. Rank 0's initial
weights and optimizer state are broadcast to all, hvd.DistributedOptimizer averages the
gradients, and rank 0 reports each epoch's loss and accuracy (averaged over the ranks) to
the driver, which prints them as training goes. At the end every rank scores the held-out
split.

    python examples/pytorch_digits.py --num-workers 2
    python examples/pytorch_digits.py --address auto --num-hosts 2 --num-workers 4
"""

from __future__ import annotations

import argparse
import sys
import time

import ray

import horovod_ray

SEED = 1234


def digits():
    """scikit-learn's digits, scaled to [0, 1]: (x_train, x_test, y_train, y_test)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    return train_test_split(images, labels, test_size=0.25, random_state=SEED, stratify=labels)


def classifier():
    """The model: two hidden layers, 10 logits."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def train(epochs: int, learning_rate: float, batch_size: int) -> dict:
    """One rank's training; returns its view of the final held-out metrics."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.manual_seed(SEED + hvd.rank())  # different until rank 0's weights are broadcast

    x_train, x_test, y_train, y_test = digits()
    # Each rank sees a disjoint shard; together they cover the training split once.
    x_shard = torch.from_numpy(x_train[hvd.rank() :: hvd.size()])
    y_shard = torch.from_numpy(y_train[hvd.rank() :: hvd.size()])

    model = classifier()
    # The effective batch is size x batch_size, so the step size scales with it.
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()

    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x_shard))
        total_loss, correct = 0.0, 0
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad()
            logits = model(x_shard[batch])
            loss = loss_fn(logits, y_shard[batch])
            loss.backward()
            optimizer.step()
            total_loss += float(loss) * len(batch)
            correct += int((logits.argmax(dim=1) == y_shard[batch]).sum())
        # Averaged over the ranks, as MetricAverageCallback does for Keras.
        metrics = hvd.allreduce(
            torch.tensor([total_loss / len(order), correct / len(order)]), name="epoch_metrics"
        )
        horovod_ray.log(
            {
                "epoch": epoch + 1,
                "epochs": epochs,
                "loss": float(metrics[0]),
                "accuracy": float(metrics[1]),
            }
        )

    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_test))
        test_loss = float(loss_fn(logits, torch.from_numpy(y_test)))
        test_accuracy = float((logits.argmax(dim=1).numpy() == y_test).mean())
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "train_examples": len(x_shard),
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
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
