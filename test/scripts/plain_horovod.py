"""A plain Horovod PyTorch script, as horovodrun runs it: no horovod_ray in it.

python plain_horovod.py allreduce        rank lines, a stderr line, env and cwd
python plain_horovod.py fail RANK CODE   RANK exits CODE, the others wait
python plain_horovod.py wait             every rank starts a child, then waits
python plain_horovod.py env              every HOROVOD_* and NCCL_* variable, sorted
python plain_horovod.py flood MB         MB megabytes of numbered lines, as fast as it can
python plain_horovod.py attempt          rank 1 exits 3 in the first attempt (HOROVOD_RAY_ATTEMPT)
"""

import os
import signal
import subprocess
import sys
import time


def allreduce() -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum)
    print(f"rank {hvd.rank()} of {hvd.size()}: local {hvd.local_rank()}, sum {total.item()}")
    print(f"rank {hvd.rank()} FOO={os.environ.get('FOO')} cwd={os.getcwd()}")
    print(f"rank {hvd.rank()} says hello on stderr", file=sys.stderr)
    print(f"rank {hvd.rank()} progress 1/2\rrank {hvd.rank()} progress 2/2")


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def fail(folder: str, rank: int, code: str) -> None:
    me, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    print(f"pid {os.getpid()}", flush=True)
    open(os.path.join(folder, f"started.{me}"), "w").close()
    if me == rank:
        for other in range(size):
            _wait_for(os.path.join(folder, f"started.{other}"))
        if code == "KILL":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(code))
    time.sleep(120)


def live(folder: str) -> None:
    # No flush: the rank's output must reach the driver unbuffered all the same.
    print(f"rank {os.environ['HOROVOD_RANK']} ready")
    _wait_for(os.path.join(folder, "go"))
    print(f"rank {os.environ['HOROVOD_RANK']} done")


def env() -> None:
    for name in sorted(os.environ):
        if name.startswith(("HOROVOD_", "NCCL_")):
            print(f"{name}={os.environ[name]}")


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def flood(megabytes: int) -> None:
    import threading

    # The rank's actor: this process's parent is the guard, whose parent is the actor.
    with open(f"/proc/{os.getppid()}/stat") as stat:
        actor = int(stat.read().rsplit(")", 1)[1].split()[1])
    # Its private memory (Ray's shared object store, also in its RSS, is not what grows).
    first = peak = _status_kb(actor, "RssAnon")
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            peak = max(peak, _status_kb(actor, "RssAnon"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    pad = "x" * 990
    for batch in range(megabytes):
        sys.stdout.write("".join(f"{batch * 1000 + i:09d} {pad}\n" for i in range(1000)))
    done.set()
    sampler.join()
    print(f"actor grew {peak - first} kB", file=sys.stderr)


def attempt() -> None:
    rank, number = os.environ["HOROVOD_RANK"], os.environ.get("HOROVOD_RAY_ATTEMPT")
    print(f"rank {rank} in attempt {number}", flush=True)
    if rank == "1" and number == "0":
        sys.exit(3)


def wait() -> None:
    child = subprocess.Popen(["sleep", "120"])
    print(f"pids {os.getpid()} {child.pid}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    action = sys.argv[1]
    if action == "allreduce":
        allreduce()
    elif action == "fail":
        fail(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif action == "live":
        live(sys.argv[2])
    elif action == "env":
        env()
    elif action == "flood":
        flood(int(sys.argv[2]))
    elif action == "attempt":
        attempt()
    else:
        wait()
