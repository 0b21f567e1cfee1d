"""A job's kinds and their plan: what to reserve, where ranks go, how they start, its life.

Open ``kinds`` for the protocol both kinds share, ``static`` for a fixed set of ranks,
``elastic`` and ``elastic_run`` for a world horovod's elastic driver decides
(``elastic_driver`` holds every use of that driver, ``discovery`` the Ray nodes it may
use, ``demand`` its request to Ray's autoscaler), ``draining`` for the nodes Ray is
about to take away (both kinds leave them), ``layouts`` for what the ranks are,
``placement`` for the placement group and its bundles, ``bringup`` for how each rank is
started (the same path for both kinds), ``sides`` for what a job keeps beside its ranks
(metrics, the run's folder, the timeline), ``attempt`` for one attempt of the job (its
kind and sides, brought up and released together; a restart makes a new one),
``restarting`` for a static job's restarts, and
``lifecycle`` for the states and the moves between them.
"""
