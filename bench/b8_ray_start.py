"""B8's split: a fresh process that only starts a local Ray as ``horovod_ray.run`` does."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from horovod_ray import local_ray  # noqa: E402

if __name__ == "__main__":
    start = time.perf_counter()
    ray.init(address="local", **local_ray.OPTIONS)
    print(time.perf_counter() - start, flush=True)
