"""When ranks fail: who failed, what the caller sees, and starting again.

Open ``attribution`` for the pure decisions (which ranks caused a failure, whether a node
was lost, an elastic run's end), ``hangs`` for a static job that hung (a stall, a silent
network), ``probe`` for looking at every rank after a failed call, and ``restarts`` for
the one restart policy (``max_restarts`` of ``run()``, ``RayExecutor`` and
``horovod-ray run``) and ``attempt()``.
"""
