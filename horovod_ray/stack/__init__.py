"""The installed horovod: what it was built with, and the check ``make install`` runs.

Open ``build`` for the cheap checks made before a job takes anything (Gloo, this
repository's horovod fixes), and ``check_install`` for ``python -m
horovod_ray.stack.check_install``.
"""
