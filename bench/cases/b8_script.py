"""B8's script: what a user runs, ``python b8_script.py WORKERS``: one allreduce on
WORKERS ranks through ``horovod_ray.run``, which starts the local Ray itself.

For the split of B8, the script also prints when its imports were done
(``imported_at``), how long ``ray.init`` took inside ``run()`` (``ray_start_s``, timed
around Ray's own function) and when ``run()`` returned (``returned_at``); nothing else is
changed. What follows ``returned_at`` is the exit: Ray's hook and the interpreter's.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402

import horovod_ray  # noqa: E402
from bench.cases import workloads  # noqa: E402

imported_at = time.time()
_ray_init = ray.init
ray_start_s: list[float] = []


def _timed_ray_init(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _ray_init(*args, **kwargs)
    finally:
        ray_start_s.append(time.perf_counter() - start)


if __name__ == "__main__":
    ray.init = _timed_ray_init
    done = horovod_ray.run(workloads.first_allreduce, num_slots=int(sys.argv[1]))
    returned_at = time.time()
    print(
        f"ranks {len(done)} ray_start_s {ray_start_s[0]} imported_at {imported_at} "
        f"returned_at {returned_at}",
        flush=True,
    )
