"""What a running job shows: metrics through Ray's pipeline, the job table in Ray's GCS,
horovod's counters and timeline (docs/observability.rst)."""
