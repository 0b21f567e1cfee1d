"""Where a run's checkpoints live, and how they get there.

Open ``spec`` for what the user asked (a storage path or filesystem, the run's name, how
many checkpoints to keep) and how it travels to the ranks, ``store`` for the run's folder
on that filesystem (commit, list, keep the best, read back as a :class:`Result`),
``files`` for reading and writing it, ``choices`` for the pure choices over its records
(the latest, the next number, what is kept, what a checkpoint's folder may be called),
``metrics`` for what a report's metrics may be and how they are stored and scored,
``upload`` for the thread that persists rank 0's checkpoints beside training
(``leftovers``: what a process leaves in its node's temporary folder), ``job`` for
what a job does with the folder at its start and end, and ``validation`` (``validator``:
the driver's thread) for ``report(validation=...)``. The ranks'
``report()`` and ``get_checkpoint()`` are in ``horovod_ray.rank.report`` (its upload
options in ``horovod_ray.rank.report_options``).
"""
