"""The command line: ``horovod-ray run`` (and ``python -m horovod_ray``), horovodrun's twin.

Open ``main`` for the parser and the run, ``flags`` for horovodrun's flags and what each
does here, ``command`` for a command on every rank (both halves), ``elastic_command`` for
``--min-np`` / ``--host-discovery-script``, ``signals`` for Ctrl-C, SIGTERM and SIGUSR1,
``rank_stacks`` for SIGUSR1's stacks, and ``rank_guard`` for the process that keeps a
rank's command tree from outliving its rank.
"""
