"""A plain Horovod TensorFlow script, as horovodrun runs it: no horovod_ray in it.

python plain_horovod.py allreduce        rank lines, a stderr line, env and cwd
python plain_horovod.py fail RANK CODE   RANK exits CODE, the others wait
python plain_horovod.py wait             every rank starts a child, then waits
"""

import os
import subprocess
import sys
import time


def allreduce() -> None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()}: local {hvd.local_rank()}, sum {total.numpy()}")
    print(f"rank {hvd.rank()} FOO={os.environ.get('FOO')} cwd={os.getcwd()}")
    print(f"rank {hvd.rank()} says hello on stderr", file=sys.stderr)
    print(f"rank {hvd.rank()} progress 1/2\rrank {hvd.rank()} progress 2/2")


def fail(rank: int, code: int) -> None:
    print(f"pid {os.getpid()}", flush=True)
    if int(os.environ["HOROVOD_RANK"]) == rank:
        time.sleep(1)
        sys.exit(code)
    time.sleep(120)


def wait() -> None:
    child = subprocess.Popen(["sleep", "120"])
    print(f"pids {os.getpid()} {child.pid}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    action = sys.argv[1]
    if action == "allreduce":
        allreduce()
    elif action == "fail":
        fail(int(sys.argv[2]), int(sys.argv[3]))
    else:
        wait()
