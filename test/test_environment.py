"""The stack works end to end, before any horovod_ray code: horovod has Gloo, and two
Ray actors given Horovod's Gloo environment by hand run a real TensorFlow allreduce."""

from __future__ import annotations

import os

import pytest
import ray
from horovod.runner.http.http_server import RendezvousServer


def test_horovod_was_built_with_gloo_and_tensorflow():
    # Importing horovod.tensorflow loads its TensorFlow extension, or raises. (horovod's
    # extension_available() checks in a child process and reads the answer without
    # waiting for it: it failed once in CI on a busy machine.)
    import horovod.tensorflow as hvd

    assert hvd.gloo_built()


@ray.remote(num_cpus=1)
class _HandMadeRank:
    def allreduce(self, env: dict) -> tuple[int, int, float]:
        os.environ.update(env)
        import horovod.tensorflow as hvd
        import tensorflow as tf

        hvd.init()
        total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)] * 3), op=hvd.Sum)
        result = (hvd.rank(), hvd.size(), float(total.numpy()[0]))
        hvd.shutdown()
        return result


@pytest.mark.timeout(120)
def test_two_ray_actors_allreduce_through_horovod_gloo(ray_4cpu):
    server = RendezvousServer()
    port = server.start()
    try:
        size = 2
        ranks = [_HandMadeRank.remote() for _ in range(size)]
        envs = [
            {
                "HOROVOD_RANK": str(rank),
                "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(rank),
                "HOROVOD_LOCAL_SIZE": str(size),
                "HOROVOD_CROSS_RANK": "0",
                "HOROVOD_CROSS_SIZE": "1",
                "HOROVOD_HOSTNAME": "host",
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": "lo",
            }
            for rank in range(size)
        ]
        results = ray.get(
            [actor.allreduce.remote(env) for actor, env in zip(ranks, envs, strict=True)]
        )
        assert results == [(0, 2, 3.0), (1, 2, 3.0)]
        for actor in ranks:
            ray.kill(actor)
    finally:
        server.stop()
