"""A plain horovod elastic PyTorch script, as horovodrun runs it: no horovod_ray in it.

python elastic_horovod.py FOLDER

Each step allreduces a one and commits ``(step, size, sum)``; rank 0 writes its latest
step and world size to FOLDER/progress; every rank stops together once FOLDER/finish
exists, and prints its node (HOROVOD_HOSTNAME) when it starts and its history at the end.
"""

import os
import sys
import time

import horovod.torch as hvd
import torch


def main(folder: str) -> None:
    hvd.init()
    print(f"started as rank {hvd.rank()} on {os.environ['HOROVOD_HOSTNAME']}", flush=True)
    state = hvd.elastic.TorchState(step=0, history=[])

    @hvd.elastic.run
    def loop(state):
        while True:
            total = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum))
            state.history = [*state.history, (state.step, hvd.size(), total)]
            finish = os.path.exists(os.path.join(folder, "finish"))
            finish = bool(hvd.broadcast(torch.tensor(int(finish)), root_rank=0))
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                path = os.path.join(folder, "progress")
                with open(path + ".tmp", "w") as handle:
                    handle.write(f"{state.step} {hvd.size()}")
                os.replace(path + ".tmp", path)
            if finish:
                return state.history
            time.sleep(0.1)

    history = loop(state)
    sizes = [size for _, size, _ in history]
    steps = [step for step, _, _ in history]
    in_step = steps == list(range(len(steps))) and all(t == s for _, s, t in history)
    print(f"rank {hvd.rank()} of {hvd.size()}: {len(steps)} steps, in step {in_step}, "
          f"sizes {sorted(set(sizes))}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
