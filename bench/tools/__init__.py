"""Tools that are not a benchmark's figure: a flood of unauthenticated request heads at a
live job's rendezvous (``flood``, run by hand and by test/faults), the GPU lines' check
that ``make test-gpu`` runs (``gpu_check``), and the C++ load generator of N simulated
ranks' rendezvous traffic (``rendezvous_load.cc``) that the scale case compiles and drives."""
