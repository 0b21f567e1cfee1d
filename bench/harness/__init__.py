"""The machinery every benchmark runs on, apart from what it measures: the modes, the
rotation of the systems, the statistics and the launchers (``common``), the table and the
plots of a run's results (``report``), and ``make bench-lines``'s runner of ``bench.run``
on both TensorFlow lines (``lines``); ``bench.run``, the command line, stays above."""
