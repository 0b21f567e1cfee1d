"""``python -m horovod_ray``: the same as the ``horovod-ray`` console script."""

import sys

from horovod_ray.cli.main import main

sys.exit(main())
