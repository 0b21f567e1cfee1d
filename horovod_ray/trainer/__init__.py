"""``HorovodTrainer``: Ray Train's trainer shape over a horovod_ray job
(``horovod_trainer``), and Ray's own ``ray.train`` functions answering on its ranks
(``ray_hook``, the one place that reaches into Ray Train's internals)."""
