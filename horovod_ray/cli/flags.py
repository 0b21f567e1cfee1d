"""horovodrun's flags in ``horovod-ray run``: every one is defined here, with the
behaviour it has on Ray.

* Tuning flags (fusion, cycle time, cache, hierarchical and torus collectives, autotune,
  timeline, stall check, library and logging options) and ``--config-file``: the
  HOROVOD_* variables horovodrun sets, on every rank.
* Flags that cannot mean anything on Ray are taken: ``--gloo`` and ``--disable-cache``
  silently (Gloo is the controller; there is no check to cache), the SSH flags with one
  warning (:data:`IGNORED`: Ray starts the ranks).
* ``-H``/``--hosts`` and ``--hostfile`` name Ray nodes; the elastic flags make an elastic
  job.
* Flags that would mislead are refused before Ray starts (:data:`REFUSED`): the MPI
  launch (``--mpi``, ``--jsrun``, ``--mpi-args``, ``--binding-args``).

What the parsed flags become (the ranks' environment through horovod's own
``config_parser``, the hosts, the elastic bounds) is ``translate``'s.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

# Set on the namespace: the destinations given on the command line, which the config file
# must not override (horovodrun's rule).
OVERRIDES = "_overrides"

# Flag -> why it is refused; each names what to do instead.
_NO_MPI = "horovod-ray runs every job with Gloo (Ray starts the ranks); drop it"
REFUSED = {
    "--mpi": f"{_NO_MPI}, or use --gloo",
    "--jsrun": _NO_MPI,
    "--mpi-args": "there is no mpirun to pass them to: Ray starts the ranks; drop it",
    "--binding-args": "there is no MPI launcher to bind with: Ray places the ranks; drop it",
}
# Flag -> why it is taken and not used (said once, on stderr, when it is given).
IGNORED = {
    "--ssh-port": "Ray starts the ranks, no SSH is used",
    "--ssh-identity-file": "Ray starts the ranks, no SSH is used",
}


class Override(argparse.Action):
    """Stores the value (or ``const``) and records that the command line gave it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        overrides = getattr(namespace, OVERRIDES, None) or set()
        overrides.add(self.dest)
        setattr(namespace, OVERRIDES, overrides)


def _value(group: Any, flag: str, kind: type, metavar: str, help: str) -> None:
    group.add_argument(flag, action=Override, type=kind, metavar=metavar, help=help)


def _switch(group: Any, on: str, off: str | None, dest: str, help: str) -> None:
    """``on`` sets ``dest`` True, ``off`` sets it False (horovodrun's pairs of flags)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(on, dest=dest, action=Override, nargs=0, const=True, help=help)
    if off is not None:
        pair.add_argument(off, dest=dest, action=Override, nargs=0, const=False, help=help)


def add_horovod_flags(run: argparse.ArgumentParser) -> None:
    """horovodrun's flags that horovod-ray has always taken, then all the others."""
    horovod = run.add_argument_group("horovodrun's flags")
    horovod.add_argument(
        "--network-interfaces",
        dest="nics",
        metavar="IF,IF",
        help="network interfaces for Gloo, in order of preference: each node uses the "
        "first it has (e.g. 'eth0,ens5')",
    )
    horovod.add_argument(
        "--start-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds Ray may take to place every rank (default: HOROVOD_START_TIMEOUT, else 100)",
    )
    horovod.add_argument(
        "--gloo-timeout-seconds",
        type=float,
        default=None,
        metavar="S",
        action=Override,
        help="seconds Gloo waits for peers (default: HOROVOD_GLOO_TIMEOUT_SECONDS, else 120)",
    )
    horovod.add_argument(
        "--output-filename",
        metavar="DIR",
        help="also write each rank's lines to DIR/rank.R/stdout and DIR/rank.R/stderr",
    )
    horovod.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a variable for every rank (repeatable); the caller's environment is "
        "passed on as well",
    )
    horovod.add_argument("--verbose", action="store_true", help="log the job's start and stop")
    add_tuning_flags(run)
    add_elastic_flags(run)
    add_other_flags(run)


def add_tuning_flags(run: argparse.ArgumentParser) -> None:
    """horovodrun's tuning flags, with its destinations (horovod's config_parser reads
    them); each sets the HOROVOD_* variable horovodrun sets."""
    params = run.add_argument_group("horovodrun's tuning flags (HOROVOD_* on every rank)")
    _value(params, "--fusion-threshold-mb", int, "MB", "fusion buffer threshold (default 128)")
    _value(params, "--cycle-time-ms", float, "MS", "delay between fusion cycles (default 1)")
    _value(params, "--cache-capacity", int, "N", "tensor names cached (default 1024)")
    for name in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        dest = name.replace("-", "_")
        _switch(params, f"--{name}", f"--no-{name}", dest, f"{name.replace('-', ' ')} on/off")
    _switch(params, "--autotune", "--no-autotune", "autotune", "autotune the parameters above")
    _value(params, "--autotune-log-file", str, "FILE", "the autotune trials' log")
    for name, kind in (
        ("warmup-samples", int),
        ("steps-per-sample", int),
        ("bayes-opt-max-samples", int),
        ("gaussian-process-noise", float),
    ):
        _value(params, f"--autotune-{name}", kind, "X", f"autotune's {name.replace('-', ' ')}")
    _value(params, "--timeline-filename", str, "FILE", "record horovod's timeline to FILE")
    _switch(
        params,
        "--timeline-mark-cycles",
        "--no-timeline-mark-cycles",
        "timeline_mark_cycles",
        "mark fusion cycles on the timeline",
    )
    _switch(params, "--no-stall-check", "--stall-check", "no_stall_check", "the stall check off")
    _value(params, "--stall-check-warning-time-seconds", int, "S", "stall warning after S s")
    _value(params, "--stall-check-shutdown-time-seconds", int, "S", "shut down after S s stalled")
    _switch(
        params,
        "--mpi-threads-disable",
        "--no-mpi-threads-disable",
        "mpi_threads_disable",
        "set HOROVOD_MPI_THREADS_DISABLE (MPI only; set as horovodrun does)",
    )
    _value(params, "--num-nccl-streams", int, "N", "NCCL streams (GPU builds)")
    _value(params, "--thread-affinity", int, "CPU", "horovod's background thread's CPU")
    params.add_argument("--tcp", action="store_true", dest="tcp_flag", help="NCCL_IB_DISABLE=1")
    _value(params, "--log-level", str, "LEVEL", "horovod's log level (TRACE ... FATAL)")
    _switch(
        params,
        "--log-with-timestamp",
        "--log-without-timestamp",
        "log_with_timestamp",
        "timestamps on horovod's log lines",
    )
    # horovodrun's older names for the two above (deprecated there since 0.21): taken, as
    # horovodrun takes them, with a warning that names the new one.
    for old_name, value in (("--log-hide-timestamp", False), ("--no-log-hide-timestamp", True)):
        params.add_argument(
            old_name,
            dest="log_with_timestamp",
            action=_Deprecated,
            nargs=0,
            const=value,
            help=argparse.SUPPRESS,
        )
    params.add_argument(
        "--config-file",
        metavar="FILE",
        help="horovodrun's YAML of the settings above; flags given here win over it",
    )


def add_other_flags(run: argparse.ArgumentParser) -> None:
    """The rest of horovodrun's flags: taken, taken and ignored, or refused (see above)."""
    other = run.add_argument_group("horovodrun's other flags (see the documentation: Command line)")
    other.add_argument("-v", "--version", action=_Version, nargs=0, help="horovod's version")
    other.add_argument(
        "-cb",
        "--check-build",
        action=_CheckBuild,
        nargs=0,
        help="the frameworks and controllers horovod was built with",
    )
    other.add_argument(
        "--network-interface",
        action="append",
        dest="nic_list",
        metavar="IF",
        help="an interface for Gloo (repeatable; horovodrun's older form)",
    )
    other.add_argument("--disable-cache", action="store_true", help="taken: nothing is cached")
    other.add_argument("-p", "--ssh-port", type=int, help="ignored with a warning: no SSH")
    other.add_argument("-i", "--ssh-identity-file", help="ignored with a warning: no SSH")
    controller = other.add_mutually_exclusive_group()
    controller.add_argument(
        "--gloo",
        dest="use_gloo",
        action="store_true",
        help="taken as horovodrun takes it: Gloo is the controller",
    )
    hidden = argparse.SUPPRESS
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", help=hidden)
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=hidden)
    # Refused in translate.resolve(), naming the way out; taken here so that the message is ours.
    other.add_argument("--mpi-args", help=hidden)
    other.add_argument("--binding-args", help=hidden)
    other.add_argument(
        "-H",
        "--hosts",
        metavar="HOST:N,...",
        help="Ray nodes by address or host name (localhost: the driver's), N ranks each",
    )
    other.add_argument(
        "-hostfile", "--hostfile", metavar="FILE", help="the same, a `HOST slots=N` line each"
    )
    other.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        action="store_true",
        help="each line starts with the time it arrived, as horovodrun's",
    )


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    """horovodrun's elastic flags: any of ``--min-np`` and ``--host-discovery-script``
    makes the job elastic (``translate.elastic_options``)."""
    elastic = parser.add_argument_group(
        "elastic (as horovodrun's; see the documentation: Elastic jobs)"
    )
    elastic.add_argument(
        "--min-np",
        "--min-num-proc",
        dest="min_np",
        type=int,
        metavar="N",
        help="elastic: the fewest ranks to train on (default: -np)",
    )
    elastic.add_argument(
        "--max-np",
        "--max-num-proc",
        dest="max_np",
        type=int,
        metavar="N",
        help="elastic: the most ranks to grow to (default: as many as fit)",
    )
    elastic.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="elastic: prints HOST[:SLOTS] lines, the Ray nodes (address, host name or "
        "node id) the job may use; SLOTS defaults to --slots-per-host, else the node's room",
    )
    elastic.add_argument(
        "--elastic-timeout",
        type=int,
        metavar="S",
        help="elastic: seconds below --min-np before the job fails "
        "(default: HOROVOD_ELASTIC_TIMEOUT, else 600)",
    )
    elastic.add_argument(
        "--reset-limit", type=int, metavar="N", help="elastic: fail after more resets"
    )
    elastic.add_argument(
        "--blacklist-cooldown-range",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="elastic: seconds a failed node is kept out, growing from LOW to HIGH",
    )


# horovodrun's deprecated spellings of a switch, and what replaced them.
_REPLACED_BY = {
    "--log-hide-timestamp": "--log-without-timestamp",
    "--no-log-hide-timestamp": "--log-with-timestamp",
}


class _Deprecated(Override):
    """horovodrun's deprecated spelling of a switch: sets it, and says which to use."""

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(
            f"{option_string} is deprecated (as in horovodrun): use {_REPLACED_BY[option_string]}",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__call__(parser, namespace, values, option_string)


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(version("horovod"))
        parser.exit()


class _CheckBuild(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from horovod.runner.launch import check_build

        check_build(verbose=False)  # prints horovod's table, then exits
