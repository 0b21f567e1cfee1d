"""Ray Tune adapter: every trial is a distributed Horovod job.

``DistributedTrainableCreator(train, num_hosts, num_slots)`` turns an ordinary Tune
function (one that calls ``ray.tune.report`` and ``ray.tune.get_checkpoint``) into a
Trainable whose trials each run ``train`` on ``num_hosts * num_slots`` Horovod ranks.

Open ``trainable`` for the trial's side (its placement, its job, the warm job kept for
the next trial) and ``session`` for the ranks' side (Tune's report and checkpoint).
"""

from horovod_ray.tune.trainable import DistributedTrainableCreator

__all__ = ["DistributedTrainableCreator"]
