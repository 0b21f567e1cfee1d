"""The benchmarks (docs/benchmarks.rst): ``python -m bench.run`` is the one command line.

By concern: ``harness`` (what every benchmark shares, the report, the two-line runner),
``cases`` (the numbered benchmarks and the work their ranks do), ``peers`` (the systems
compared against that are not a part of a case: raw Gloo, Ray Train v2's drain) and
``tools`` (a flood of the rendezvous, the GPU lines' check, the rendezvous load generator).
"""
