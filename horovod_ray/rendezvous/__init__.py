"""Horovod's Gloo rendezvous: the job's key-value store, where ranks find their peers.

Open ``server`` for the server a job runs (bound, allowlisted, keyed by the job's secret),
``cluster`` for the same in an actor when the driver is out of the workers' reach,
``http_front`` for the requests it answers on one event loop, ``store`` for the keys and
held reads, and ``wire`` for the batched bodies this repository's horovod build sends.
"""
