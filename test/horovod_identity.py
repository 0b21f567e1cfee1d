"""What Horovod says about a rank, shared by tests that run it on real ranks.

Tests that need *a* Horovod rank, not a given framework, run ``horovod.torch``: a rank
imports it in about a quarter of TensorFlow's time, and that import is most of what a
test's job costs (docs/testing.rst). Tests of a framework's own API import that framework.
"""

from __future__ import annotations


def horovod_identity() -> dict:
    """Inits Horovod, sums rank + 1 over every rank, and returns what Horovod says."""
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "sum": float(total),
    }
