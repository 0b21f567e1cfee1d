"""``python -m horovod_ray._check_install``: the post-install check of ``make install``.

Asks horovod itself (each probe loads an extension in a subprocess) whether it was built
with TensorFlow and Gloo; prints one line and exits non-zero if not.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from horovod_ray._stack import INSTALL_HINT, require_gloo  # noqa: E402


def _full_check() -> int:
    from horovod.common.util import extension_available, gloo_built

    failures = []
    if not extension_available("tensorflow"):
        failures.append("TensorFlow")
    if not gloo_built():
        failures.append("Gloo")
    if failures:
        print(
            f"horovod_ray: horovod lacks {' and '.join(failures)}; {INSTALL_HINT}", file=sys.stderr
        )
        return 1
    require_gloo()  # the executor's cheap check must agree
    print("horovod_ray: horovod has Gloo and TensorFlow")
    return 0


if __name__ == "__main__":
    sys.exit(_full_check())
