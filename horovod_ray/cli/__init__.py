"""The command line: ``horovod-ray run`` (and ``python -m horovod_ray``), horovodrun's twin.

Open ``parser`` for the parser, ``flags`` for horovodrun's flags and what each does
here, ``translate`` for what the parsed flags become (the ranks' environment, the hosts,
the elastic bounds), ``main`` for the run and its exit status, ``command`` for a command
on every rank (both halves) and ``output`` for its lines on the driver,
``elastic_command`` for ``--min-np`` / ``--host-discovery-script``, ``signals`` for
Ctrl-C, SIGTERM and SIGUSR1, ``rank_stacks`` for SIGUSR1's stacks, and ``rank_guard`` for
the process that keeps a rank's command tree from outliving its rank.
"""
