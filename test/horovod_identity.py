"""What Horovod says about a rank, shared by tests that run it on real ranks."""

from __future__ import annotations


def horovod_identity() -> dict:
    """Inits Horovod, sums rank + 1 over every rank, and returns what Horovod says."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "sum": float(total.numpy()),
    }
