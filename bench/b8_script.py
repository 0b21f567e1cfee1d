"""B8's script: what a user runs, ``python b8_script.py WORKERS``: one allreduce on
WORKERS ranks through ``horovod_ray.run``, which starts the local Ray itself."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import horovod_ray  # noqa: E402
from bench import workloads  # noqa: E402

if __name__ == "__main__":
    done = horovod_ray.run(workloads.first_allreduce, num_slots=int(sys.argv[1]))
    print(len(done), flush=True)
