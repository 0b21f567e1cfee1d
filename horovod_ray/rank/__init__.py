"""One Horovod rank: its actor, its numbers, and what travels between it and the driver.

Open ``worker`` for the Ray actor that hosts a rank, ``session`` for the rank's state for
its job (one object, installed by the worker), ``assignment`` for world, local and cross
ranks (pure), ``network`` for the interface its Gloo uses, ``priority`` for its niceness,
``calls`` for how a function call reaches it, and ``logs`` for ``log()`` on its way back.
What a training function calls on a rank: ``report`` (with ``report_options``, and
``dropped`` for the other ranks' checkpoints), ``context``, ``datasets`` (``ordered`` for
an ordered split), ``preemption``; beside it: ``metrics``, ``timeline``, ``frameworks``
(horovod's frameworks, shut down); ``local`` runs a function as a rank in the caller's
process. A rank is started by the job (``horovod_ray.job.bringup``).
"""
