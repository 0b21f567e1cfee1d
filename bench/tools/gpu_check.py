"""``make test-gpu``: the GPU lines' check on a machine with NVIDIA GPUs
(``python -m bench.tools.gpu_check --framework torch|tensorflow``; docs/gpus.rst).

Through ``horovod_ray.run(..., use_gpu=True)``, on 2 ranks, each on a GPU of its own, where
Ray sees two GPUs or more, else on 1 (NCCL refuses two ranks of one communicator on one
device), each rank:

* joins Horovod and checks that its horovod was built with NCCL and CUDA;
* runs an allreduce, an allgather and a broadcast on tensors in its GPU's memory, the
  results staying on the GPU;
* takes one ``hvd.DistributedOptimizer`` step from different initial weights and data per
  rank, after a broadcast of rank 0's weights (PyTorch: a step of ``torch.optim.SGD``;
  TensorFlow: Keras 3's ``model.fit``, compiled with ``jit_compile=False`` as docs/gpus.rst
  advises): every rank must end with the same weights, and they must be the ones a plain
  step along the averaged gradient reaches;
* times ``--iters`` allreduces of a ``--mb`` float32 tensor through horovod (NCCL) and, with
  PyTorch, through ``torch.distributed``'s nccl backend in the same processes, on the same
  tensor (with one rank there is no peer, and no figure).

``--device cpu`` runs the same on CPU tensors (Gloo for both), which is how ``make test``
checks this script on machines without a GPU. Exit status: 0 when every check holds, 1
when one fails, 2 when no GPU is there to check.
"""

from __future__ import annotations

import argparse
import sys

from bench.cases.bt import free_port  # the port torch.distributed's group meets on
from bench.harness.common import timed  # (bt loads it first: Ray's environment before ray)
from horovod_ray.stack.build import nccl_version

WARMUP = 3


def _seconds(allreduce, data, iters: int, synchronize) -> float:
    return timed(lambda: allreduce(data), iters, WARMUP, synchronize, synchronize)


def _optimizer_step(hvd, torch, device) -> dict:
    """One DistributedOptimizer step against a plain SGD step on the averaged gradient."""
    torch.manual_seed(hvd.rank())  # different weights and data on each rank
    model = torch.nn.Linear(16, 4).to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    every_rank = hvd.allgather(after.unsqueeze(0), name="gpu_check.weights")
    identical = all(torch.equal(row, every_rank[0]) for row in every_rank)

    # The plain step: the same model from the same start, the gradient averaged by hand.
    plain = torch.nn.Linear(16, 4).to(device)
    with torch.no_grad():
        for p, value in zip(plain.parameters(), start, strict=True):
            p.copy_(value)
    torch.nn.functional.mse_loss(plain(x), y).backward()
    with torch.no_grad():
        for index, p in enumerate(plain.parameters()):
            grad = hvd.allreduce(p.grad, op=hvd.Average, name=f"gpu_check.grad.{index}")
            p -= 0.1 * grad
    expected = torch.cat([p.detach().flatten() for p in plain.parameters()])
    return {
        "weights identical on every rank": identical,
        "weights those of the averaged step": bool(torch.allclose(after, expected, atol=1e-6)),
    }


def torch_rank_checks(device_kind: str, nbytes: int, iters: int) -> dict:
    """What one rank finds with horovod.torch; runs inside a horovod_ray rank."""
    import horovod.torch as hvd
    import ray
    import torch
    import torch.distributed as dist

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    found: dict = {"rank": rank, "nccl built": hvd.nccl_built(), "cuda built": hvd.cuda_built()}
    if device_kind == "cuda":
        # horovod_ray shows a rank its node's GPUs; its own is the local rank's.
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
        found["gpu"] = torch.cuda.get_device_name(device)
        synchronize = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        synchronize = lambda: None  # noqa: E731

    ones = torch.full((1024,), float(rank + 1), device=device)
    summed = hvd.allreduce(ones, op=hvd.Sum, name="gpu_check.sum")
    found["allreduce on the device"] = summed.device == device and bool(
        torch.all(summed == size * (size + 1) / 2)
    )
    gathered = hvd.allgather(torch.tensor([rank], device=device), name="gpu_check.gather")
    found["allgather on the device"] = gathered.device == device and gathered.tolist() == list(
        range(size)
    )
    sent = hvd.broadcast(torch.tensor([rank + 10.0], device=device), 0, name="gpu_check.bcast")
    found["broadcast on the device"] = sent.device == device and sent.tolist() == [10.0]
    found.update(_optimizer_step(hvd, torch, device))

    data = torch.ones(nbytes // 4, device=device)
    seconds = _seconds(
        lambda t: hvd.allreduce_(t, op=hvd.Sum, name="gpu_check.bw"), data, iters, synchronize
    )
    found["horovod MB/s"] = nbytes * iters / seconds / 1e6
    if size > 1:
        address = hvd.broadcast_object(
            (ray.util.get_node_ip_address(), free_port()) if rank == 0 else None,
            root_rank=0,
            name="gpu_check.address",  # by default the name is the object's type's
        )
        dist.init_process_group(
            "nccl" if device_kind == "cuda" else "gloo",
            init_method=f"tcp://{address[0]}:{address[1]}",
            rank=rank,
            world_size=size,
        )
        try:
            seconds = _seconds(dist.all_reduce, data, iters, synchronize)
        finally:
            dist.destroy_process_group()
        found["torch.distributed MB/s"] = nbytes * iters / seconds / 1e6
    return found


def _keras_step(hvd, tf, device: str) -> dict:
    """One Keras 3 ``fit`` step with horovod's DistributedOptimizer against a plain SGD step
    along the averaged gradient, from rank 0's weights and each rank's own data."""
    import horovod.tensorflow.keras as hvd_keras
    import keras
    import numpy as np

    rng = np.random.default_rng(hvd.rank())  # different data on each rank
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    with tf.device(device):
        keras.utils.set_random_seed(hvd.rank())  # and different initial weights
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
        hvd.broadcast_variables(model.variables, root_rank=0)
        start = model.get_weights()
        optimizer = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1))
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
        after = np.concatenate([w.ravel() for w in model.get_weights()])
        every_rank = hvd.allgather(tf.constant(after[None, :]), name="gpu_check.weights").numpy()

        # The plain step: the same start, the gradient averaged by hand.
        kernel, bias = tf.Variable(start[0]), tf.Variable(start[1])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ kernel + bias - y))
        grads = [
            hvd.allreduce(grad, op=hvd.Average, name=f"gpu_check.grad.{index}").numpy()
            for index, grad in enumerate(tape.gradient(loss, [kernel, bias]))
        ]
    expected = np.concatenate([(w - 0.1 * g).ravel() for w, g in zip(start, grads, strict=True)])
    return {
        "weights identical on every rank": all((row == every_rank[0]).all() for row in every_rank),
        "weights those of the averaged step": bool(np.allclose(after, expected, atol=1e-5)),
    }


def tensorflow_rank_checks(device_kind: str, nbytes: int, iters: int) -> dict:
    """What one rank finds with horovod.tensorflow; runs inside a horovod_ray rank."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    found: dict = {"rank": rank, "nccl built": hvd.nccl_built(), "cuda built": hvd.cuda_built()}
    if device_kind == "cuda":
        # horovod_ray shows a rank its node's GPUs; its own is the local rank's, and the
        # only one this process keeps.
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
        device = "/GPU:0"
        found["gpu"] = tf.config.experimental.get_device_details(gpus[hvd.local_rank()]).get(
            "device_name", "GPU"
        )
    else:
        device = "/CPU:0"

    def on_device(tensor) -> bool:
        return tensor.device.endswith(device.lstrip("/"))

    with tf.device(device):
        summed = hvd.allreduce(tf.fill([1024], float(rank + 1)), op=hvd.Sum, name="gpu_check.sum")
        # A float: TensorFlow keeps small integer tensors in host memory, on any device.
        gathered = hvd.allgather(tf.constant([float(rank)]), name="gpu_check.gather")
        sent = hvd.broadcast(tf.constant([rank + 10.0]), 0, name="gpu_check.bcast")
        data = tf.ones([nbytes // 4])
    found["allreduce on the device"] = on_device(summed) and bool(
        tf.reduce_all(summed == size * (size + 1) / 2)
    )
    found["allgather on the device"] = on_device(gathered) and gathered.numpy().tolist() == list(
        range(size)
    )
    found["broadcast on the device"] = on_device(sent) and sent.numpy().tolist() == [10.0]
    found.update(_keras_step(hvd, tf, device))

    # An eager allreduce returns once horovod has finished it: nothing to synchronize.
    with tf.device(device):
        seconds = _seconds(
            lambda t: hvd.allreduce(t, op=hvd.Sum, name="gpu_check.bw"), data, iters, lambda: None
        )
    found["horovod MB/s"] = nbytes * iters / seconds / 1e6
    return found


RANK_CHECKS = {"torch": torch_rank_checks, "tensorflow": tensorflow_rank_checks}

CHECKS = (
    "allreduce on the device",
    "allgather on the device",
    "broadcast on the device",
    "weights identical on every rank",
    "weights those of the averaged step",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.gpu_check", description=__doc__)
    parser.add_argument(
        "--framework",
        choices=sorted(RANK_CHECKS),
        default="torch",
        help="horovod.torch (the GPU line, make install GPU=1) or horovod.tensorflow (GPU=tf)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--mb", type=int, default=64, help="the timed tensor's size in MB")
    parser.add_argument("--iters", type=int, default=20, help="timed allreduces per peer")
    args = parser.parse_args(argv)

    import ray

    import horovod_ray

    ray.init(ignore_reinit_error=True, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if args.device == "cuda" and gpus == 0:
        print(
            "gpu_check: Ray sees no GPU on this machine; make test-gpu runs on a machine with "
            "NVIDIA GPUs and their driver (docs/gpus.rst). Without one: --device cpu",
            file=sys.stderr,
        )
        return 2
    ranks = 2 if args.device == "cpu" or gpus >= 2 else 1
    results = horovod_ray.run(
        RANK_CHECKS[args.framework],
        kwargs={"device_kind": args.device, "nbytes": args.mb * 2**20, "iters": args.iters},
        num_slots=ranks,
        use_gpu=args.device == "cuda",
    )
    failed = False
    for found in results:
        rank = found["rank"]
        nccl = found["nccl built"]
        print(
            f"rank {rank}: {found.get('gpu', 'cpu')}; horovod built "
            + (f"with NCCL {nccl_version(nccl)}" if nccl else "without NCCL")
            + (" and CUDA" if found["cuda built"] else ", without CUDA")
        )
        for check in CHECKS:
            print(f"rank {rank}: {check}: {'ok' if found[check] else 'FAILED'}")
            failed |= not found[check]
    if args.device == "cuda" and not all(r["nccl built"] and r["cuda built"] for r in results):
        build = "GPU=1" if args.framework == "torch" else "GPU=tf"
        print(f"gpu_check: horovod lacks NCCL or CUDA: make install {build}", file=sys.stderr)
        failed = True
    zero = results[0]
    line = (
        f"allreduce of {args.mb} MB x {args.iters} on {ranks} rank(s): "
        f"horovod {zero['horovod MB/s']:.0f} MB/s"
    )
    if "torch.distributed MB/s" in zero:
        peer = zero["torch.distributed MB/s"]
        line += f", torch.distributed {peer:.0f} MB/s, ratio {zero['horovod MB/s'] / peer:.2f}"
    elif args.framework == "tensorflow":
        line += " (TensorFlow: no peer in this check)"
    else:
        line += " (one rank: no peer, no comparison)"
    print(line)
    print("gpu_check: FAILED" if failed else "gpu_check: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
