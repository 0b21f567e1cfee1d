"""A horovod elastic TensorFlow loop for the elastic tests: one commit per step.

Each step allreduces a one and records ``(step, size, sum)`` in the committed state, so
the final history shows every step exactly once and the world size it ran at. Every rank
logs ``{"step", "size"}`` (only rank 0's reach the callbacks). Rank 0 writes its latest
step and size to ``progress`` (the test watches it); the loop ends once ``finish`` exists,
a decision every rank takes together (a broadcast from rank 0).
"""

from __future__ import annotations

import os
import time

import horovod_ray


def train(folder: str, pause_s: float = 0.1, max_steps: int = 10_000) -> dict:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    state = hvd.elastic.ObjectState(
        bcast_object=hvd.broadcast_object, get_rank=hvd.rank, step=0, history=[]
    )

    @hvd.elastic.run
    def loop(state):
        while state.step < max_steps:
            total = hvd.allreduce(tf.constant(1.0), op=hvd.Sum)
            # Rebound, not appended in place: restore() must roll the list back too.
            state.history = [*state.history, (state.step, hvd.size(), float(total.numpy()))]
            finish = os.path.exists(os.path.join(folder, "finish"))
            finish = bool(hvd.broadcast(tf.constant(int(finish)), root_rank=0).numpy())
            state.step += 1
            state.commit()
            horovod_ray.log({"step": state.step, "size": hvd.size()})  # rank 0's reach us
            if hvd.rank() == 0:
                path = os.path.join(folder, "progress")
                with open(path + ".tmp", "w") as handle:
                    handle.write(f"{state.step} {hvd.size()}")
                os.replace(path + ".tmp", path)
            if finish:
                break
            time.sleep(pause_s)
        return state.history

    history = loop(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "history": history}
