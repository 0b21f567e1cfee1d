"""The host discoveries a user hands an elastic job, horovod.ray's, which
``horovod_ray.elastic`` exports as horovod.ray's ``elastic`` module did.

Open ``ray_nodes`` for ``RayHostDiscovery`` (Ray's nodes with room, counted as horovod.ray
counts them) and ``chaos`` for ``TestDiscovery`` (a discovery's hosts hidden and shown
again on a timer, to exercise an elastic job). The job's own reading of Ray's node table,
which such a discovery narrows, is ``job/discovery``.
"""
