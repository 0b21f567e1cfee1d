"""horovod.ray's ``ray_logger``, for code that imports it: ``ray_logger.log(info_dict)``
in a rank hands the dict to the callbacks given to ``run()``/``execute()`` on the driver.

As with horovod.ray, an elastic job delivers every rank's dicts (``horovod_ray.log``
delivers rank 0's only, so training code needs no rank check); a static job delivers
rank 0's, as horovod.ray's ``RayExecutor`` documents. Outside a horovod_ray rank it does
nothing.
"""

from horovod_ray.rank.logs import log_any_rank as log

__all__ = ["log"]
