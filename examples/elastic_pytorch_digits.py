"""An elastic Horovod job on Ray in PyTorch: digits that survive lost ranks and grow back.

The training function is horovod's PyTorch elastic API, unchanged: a ``TorchState``
holding the model, the optimizer, an ``ElasticSampler`` and the epoch, committed after
every batch, and ``hvd.elastic.run`` around the loop. When a rank or a node is lost, the
others roll back to the last commit and go on with fewer ranks (no fewer than
``--min-workers``), the sampler handing out what is left of the epoch among them; when Ray
has room again, new ranks join at a commit, up to ``--max-workers``. The driver prints each
change of membership.

    python examples/elastic_pytorch_digits.py --min-workers 2 --max-workers 4
    python examples/elastic_pytorch_digits.py --address auto --min-workers 2 --max-workers 8
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
    import horovod.torch as hvd
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    hvd.init()
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (images / 16.0).astype(np.float32), labels, test_size=0.25, random_state=SEED,
        stratify=labels,
    )  # fmt: skip
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=SEED)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=learning_rate),
        named_parameters=model.named_parameters(),
    )
    loss_fn = torch.nn.CrossEntropyLoss()
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def loop(state):
        while state.epoch < epochs:
            # The sampler shards what is left of the epoch over the ranks there are now.
            for x, y in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(0, batch_size)
                state.commit()
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch + 1:>2}/{epochs}  loss {float(loss):.4f}  "
                    f"ranks {hvd.size()}",
                    flush=True,
                )
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    loop(state)
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "test_accuracy": float(np.mean(predicted == y_test)),
    }


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
