"""A driver on a cluster whose nodes Ray's autoscaler launches (RAY_ADDRESS): an elastic
job with min_workers=2, max_workers=6 on 1-CPU ranks, from a head without CPUs. Prints
one JSON line: rank 0's world size at each step, the seconds from the run() call to the
world at 6 ranks (None: never), the autoscaler request left once run() returned, the
worker nodes alive then, and the seconds until the idle nodes were gone (None: not within
60 s)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray

import horovod_ray
from test.autoscaling import alive_worker_nodes, standing_request
from test.elastic_training import grow_after_a_slow_start


def main(folder: str) -> None:
    ray.init(logging_level="ERROR", log_to_driver=False)
    Path(folder, "go").touch()  # no slow start: the ranks enter their loop at once
    called, at_six = time.monotonic(), []

    class AtSix(horovod_ray.Callback):
        def on_membership(self, change: dict) -> None:
            if change["size_after"] == 6 and not at_six:
                at_six.append(round(time.monotonic() - called, 1))

    results = horovod_ray.run(
        grow_after_a_slow_start,
        args=(folder, 6),
        min_workers=2,
        max_workers=6,
        cpus_per_slot=1,
        elastic_timeout=120,
        callbacks=[AtSix()],
    )
    ended = time.monotonic()
    request, nodes_at_end = standing_request(), alive_worker_nodes()
    while alive_worker_nodes() and time.monotonic() - ended < 60:
        time.sleep(0.5)
    gone_s = None if alive_worker_nodes() else round(time.monotonic() - ended, 1)
    to_six_s = at_six[0] if at_six else None
    outcome = {
        "sizes": results[0],
        "to_max_workers_s": to_six_s,
        "request": request,
        "nodes_at_end": nodes_at_end,
    }
    print(json.dumps({**outcome, "idle_nodes_gone_s": gone_s}))


if __name__ == "__main__":
    main(sys.argv[1])
