"""Ray Data feeding a job: the datasets a user passes checked (``spec``), split over the
ranks with Ray's own ``DataConfig`` and ``streaming_split`` as the job starts, and released
with it (``feed``), the ranks' resources kept out of Ray Data's budget (``budget``). A
rank takes its part with ``horovod_ray.get_dataset_shard`` (``rank/datasets``)."""
