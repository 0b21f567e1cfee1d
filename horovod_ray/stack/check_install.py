"""``python -m horovod_ray.stack.check_install``: the post-install check of ``make install``.

Asks horovod itself (each probe loads an extension in a subprocess) whether it was built
with TensorFlow and Gloo, and with PyTorch where PyTorch is installed, exiting non-zero
if not, and says whether it carries the Gloo
interface fix and, on Keras 3, the Keras 3 port from ``patches/`` (a stock build still
runs collectives, with the hostname caveat; ``--require-fix``, which ``make install``
passes, makes the absence of either an error).
"""

import importlib.util
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from horovod_ray.stack.build import (  # noqa: E402
    INSTALL_HINT,
    TORCH_HINT,
    batched_rendezvous,
    gloo_iface_fixed,
    keras3_port,
    require_gloo,
    sync_batch_norm_on_cpu,
)


def _full_check(require_fix: bool) -> int:
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
    if importlib.util.find_spec("torch") is None:
        print("horovod_ray: PyTorch is not installed (horovod.torch needs it and a rebuild)")
    elif extension_available("torch"):
        print("horovod_ray: horovod has PyTorch (horovod.torch)")
        if sync_batch_norm_on_cpu():
            print("horovod_ray: horovod has SyncBatchNorm on CPUs (horovod.torch)")
        else:
            print("horovod_ray: horovod's SyncBatchNorm is GPU-only, as released")
    else:
        print(
            "horovod_ray: PyTorch is installed but horovod lacks its extension, so "
            f"horovod.torch fails; {TORCH_HINT}",
            file=sys.stderr,
        )
        return 1
    if batched_rendezvous():
        print("horovod_ray: horovod has the batched rendezvous (a few requests per rank)")
    else:
        print("horovod_ray: horovod sends Gloo's per-key rendezvous (slow past ~100 ranks)")
    port = keras3_port()
    if port:
        print("horovod_ray: horovod has the Keras 3 port (horovod.tensorflow.keras on Keras 3)")
    elif port is False:
        print(
            "horovod_ray: horovod lacks the Keras 3 port: horovod.tensorflow.keras, "
            "broadcast_variables and DistributedGradientTape fail on Keras 3 models; "
            "`make install` in a horovod_ray checkout builds horovod with the port",
            file=sys.stderr,
        )
        if require_fix:
            return 1
    if gloo_iface_fixed():
        print("horovod_ray: horovod has the Gloo interface fix (collectives use the chosen NIC)")
    else:
        print(
            "horovod_ray: horovod lacks the Gloo interface fix: a job across hosts needs each "
            "host's name to resolve to a routable address (not 127.0.1.1); `make install` in "
            "a horovod_ray checkout builds horovod with the fix",
            file=sys.stderr if require_fix else sys.stdout,
        )
        return 1 if require_fix else 0
    return 0


if __name__ == "__main__":
    sys.exit(_full_check(require_fix="--require-fix" in sys.argv[1:]))
