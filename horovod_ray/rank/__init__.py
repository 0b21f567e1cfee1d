"""One Horovod rank: its actor, its numbers, and what travels between it and the driver.

Open ``worker`` for the Ray actor that hosts a rank, ``assignment`` for world, local and
cross ranks (pure), ``network`` for the interface its Gloo uses, ``priority`` for its
niceness, ``calls`` for how a function call reaches it, and ``logs`` for ``log()`` on its
way back. A rank is started by the job (``horovod_ray.job.bringup``).
"""
