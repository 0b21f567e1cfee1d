"""A driver on a cluster whose nodes Ray's autoscaler launches (RAY_ADDRESS): an elastic
job with min_workers=2, max_workers=6 on 1-CPU ranks, from a head without CPUs. Prints
one JSON line: rank 0's world size at each step, the autoscaler request left once run()
returned, and the seconds until the idle nodes were gone (None: not within 60 s)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray

import horovod_ray
from test.elastic_training import grow_after_a_slow_start


def _request() -> list:
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def _worker_nodes() -> int:
    return sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU"))


def main(folder: str) -> None:
    ray.init(logging_level="ERROR", log_to_driver=False)
    Path(folder, "go").touch()  # no slow start: the ranks enter their loop at once
    results = horovod_ray.run(
        grow_after_a_slow_start,
        args=(folder, 6),
        min_workers=2,
        max_workers=6,
        cpus_per_slot=1,
        elastic_timeout=120,
    )
    ended = time.monotonic()
    request = _request()
    while _worker_nodes() and time.monotonic() - ended < 60:
        time.sleep(0.5)
    gone_s = None if _worker_nodes() else round(time.monotonic() - ended, 1)
    print(json.dumps({"sizes": results[0], "request": request, "idle_nodes_gone_s": gone_s}))


if __name__ == "__main__":
    main(sys.argv[1])
