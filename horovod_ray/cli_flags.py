"""horovodrun's flags in ``horovod-ray run``: every one has a defined behaviour here.

* Tuning flags (fusion, cycle time, cache, hierarchical and torus collectives, autotune,
  timeline, stall check, library and logging options) and ``--config-file`` set the
  HOROVOD_* variables horovodrun sets, on every rank. horovod's own ``config_parser``
  does it, as for horovodrun: ``set_args_from_config`` reads the YAML (a flag given on
  the command line wins over the file), ``validate_config_args`` checks the values and
  ``set_env_from_args`` maps them.
* Flags that cannot mean anything on Ray are taken: ``--gloo`` and ``--disable-cache``
  silently (Gloo is the controller; there is no check to cache), the SSH flags with one
  warning (Ray starts the ranks).
* ``-H``/``--hosts`` and ``--hostfile`` name Ray nodes (:func:`host_list`).
* The elastic flags make an elastic job (:func:`elastic_options`).
* Flags that would mislead are refused before Ray starts: the MPI launch (``--mpi``,
  ``--jsrun``, ``--mpi-args``, ``--binding-args``).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

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
        "--network-interfaces", dest="nics", metavar="IF,IF",
        help="network interfaces for Gloo, in order of preference: each node uses the "
        "first it has (e.g. 'eth0,ens5')",
    )  # fmt: skip
    horovod.add_argument(
        "--start-timeout", type=float, default=None, metavar="S",
        help="seconds Ray may take to place every rank (default: HOROVOD_START_TIMEOUT, "
        "else 100)",
    )  # fmt: skip
    horovod.add_argument(
        "--gloo-timeout-seconds", type=float, default=None, metavar="S", action=Override,
        help="seconds Gloo waits for peers (default: HOROVOD_GLOO_TIMEOUT_SECONDS, else 120)",
    )  # fmt: skip
    horovod.add_argument(
        "--output-filename", metavar="DIR",
        help="also write each rank's lines to DIR/rank.R/stdout and DIR/rank.R/stderr",
    )  # fmt: skip
    horovod.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE",
        help="set a variable for every rank (repeatable); the caller's environment is "
        "passed on as well",
    )  # fmt: skip
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
        params, "--timeline-mark-cycles", "--no-timeline-mark-cycles", "timeline_mark_cycles",
        "mark fusion cycles on the timeline",
    )  # fmt: skip
    _switch(params, "--no-stall-check", "--stall-check", "no_stall_check", "the stall check off")
    _value(params, "--stall-check-warning-time-seconds", int, "S", "stall warning after S s")
    _value(params, "--stall-check-shutdown-time-seconds", int, "S", "shut down after S s stalled")
    _switch(
        params, "--mpi-threads-disable", "--no-mpi-threads-disable", "mpi_threads_disable",
        "set HOROVOD_MPI_THREADS_DISABLE (MPI only; set as horovodrun does)",
    )  # fmt: skip
    _value(params, "--num-nccl-streams", int, "N", "NCCL streams (GPU builds)")
    _value(params, "--thread-affinity", int, "CPU", "horovod's background thread's CPU")
    params.add_argument("--tcp", action="store_true", dest="tcp_flag", help="NCCL_IB_DISABLE=1")
    _value(params, "--log-level", str, "LEVEL", "horovod's log level (TRACE ... FATAL)")
    _switch(
        params, "--log-with-timestamp", "--log-without-timestamp", "log_with_timestamp",
        "timestamps on horovod's log lines",
    )  # fmt: skip
    params.add_argument(
        "--config-file", metavar="FILE",
        help="horovodrun's YAML of the settings above; flags given here win over it",
    )  # fmt: skip


def add_other_flags(run: argparse.ArgumentParser) -> None:
    """The rest of horovodrun's flags: taken, taken and ignored, or refused (see above)."""
    other = run.add_argument_group("horovodrun's other flags (docs: Command line)")
    other.add_argument("-v", "--version", action=_Version, nargs=0, help="horovod's version")
    other.add_argument(
        "-cb", "--check-build", action=_CheckBuild, nargs=0,
        help="the frameworks and controllers horovod was built with",
    )  # fmt: skip
    other.add_argument(
        "--network-interface", action="append", dest="nic_list", metavar="IF",
        help="an interface for Gloo (repeatable; horovodrun's older form)",
    )  # fmt: skip
    other.add_argument("--disable-cache", action="store_true", help="taken: nothing is cached")
    other.add_argument("-p", "--ssh-port", type=int, help="ignored with a warning: no SSH")
    other.add_argument("-i", "--ssh-identity-file", help="ignored with a warning: no SSH")
    controller = other.add_mutually_exclusive_group()
    controller.add_argument(
        "--gloo", dest="use_gloo", action="store_true",
        help="taken as horovodrun takes it: Gloo is the controller",
    )  # fmt: skip
    hidden = argparse.SUPPRESS
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", help=hidden)
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=hidden)
    # Refused in resolve(), naming the way out; taken here so that the message is ours.
    other.add_argument("--mpi-args", help=hidden)
    other.add_argument("--binding-args", help=hidden)
    other.add_argument(
        "-H", "--hosts", metavar="HOST:N,...",
        help="Ray nodes by address or host name (localhost: the driver's), N ranks each",
    )  # fmt: skip
    other.add_argument(
        "-hostfile", "--hostfile", metavar="FILE", help="the same, a `HOST slots=N` line each"
    )
    other.add_argument(
        "-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
        help="each line starts with the time it arrived, as horovodrun's",
    )  # fmt: skip


def add_elastic_flags(parser: argparse.ArgumentParser) -> None:
    """horovodrun's elastic flags: any of ``--min-np`` and ``--host-discovery-script``
    makes the job elastic (:func:`elastic_options`)."""
    elastic = parser.add_argument_group("elastic (as horovodrun's; docs: Elastic jobs)")
    elastic.add_argument(
        "--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
        help="elastic: the fewest ranks to train on (default: -np)",
    )  # fmt: skip
    elastic.add_argument(
        "--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
        help="elastic: the most ranks to grow to (default: as many as fit)",
    )  # fmt: skip
    elastic.add_argument(
        "--host-discovery-script", metavar="SCRIPT",
        help="elastic: prints HOST[:SLOTS] lines, the Ray nodes (address, host name or "
        "node id) the job may use; SLOTS defaults to --slots-per-host, else the node's room",
    )  # fmt: skip
    elastic.add_argument(
        "--elastic-timeout", type=int, metavar="S",
        help="elastic: seconds below --min-np before the job fails "
        "(default: HOROVOD_ELASTIC_TIMEOUT, else 600)",
    )  # fmt: skip
    elastic.add_argument(
        "--reset-limit", type=int, metavar="N", help="elastic: fail after more resets"
    )
    elastic.add_argument(
        "--blacklist-cooldown-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="elastic: seconds a failed node is kept out, growing from LOW to HIGH",
    )  # fmt: skip


_ELASTIC_ONLY = ("max_np", "elastic_timeout", "reset_limit", "blacklist_cooldown_range")


def elastic_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The elastic flags as ``RayExecutor``'s elastic arguments; None for a static job.

    As horovodrun: ``--min-np`` defaults to ``-np``; the hosts come from the discovery
    script, else ``-H``/``--hostfile`` (all their slots), else (ours) every Ray node.

    Raises:
        ValueError: Naming the flag that does not fit.
    """
    from horovod.runner.elastic.discovery import FixedHosts, HostDiscoveryScript

    if args.min_np is None and args.host_discovery_script is None:
        for dest in _ELASTIC_ONLY:
            if getattr(args, dest) is not None:
                flag = "--" + dest.replace("_", "-")
                raise ValueError(f"{flag} is for elastic jobs: give --min-np N too")
        return None
    if args.num_hosts is not None:
        raise ValueError("--num-hosts: an elastic job sizes itself; give --min-np/--max-np")
    min_np = args.min_np if args.min_np is not None else args.num_proc
    if min_np is None:
        raise ValueError("--min-np: give the fewest ranks to train on (--min-np N or -np N)")
    hosts = host_list(argparse.Namespace(**{**vars(args), "num_proc": None}))
    if args.host_discovery_script is not None:
        if hosts is not None:
            raise ValueError("--host-discovery-script and -H/--hostfile: give one of them")
        discovery: Any = HostDiscoveryScript(args.host_discovery_script, args.slots_per_host)
    else:
        discovery = True if hosts is None else FixedHosts(dict(hosts))
    timeout = args.elastic_timeout
    if timeout is None:
        timeout = int(os.environ.get("HOROVOD_ELASTIC_TIMEOUT", "600"))
    cooldown = args.blacklist_cooldown_range
    return {
        "min_workers": min_np,
        "max_workers": args.max_np,
        "reset_limit": args.reset_limit,
        "cooldown_range": None if cooldown is None else tuple(cooldown),
        "elastic_timeout": timeout,
        "override_discovery": discovery,
    }


FLAG_OF = {  # RayExecutor's parameters as the flags that set them
    "num_workers": "-np",
    "num_hosts": "--num-hosts",
    "num_workers_per_host": "--slots-per-host",
    "cpus_per_worker": "--cpus-per-worker",
    "gpus_per_worker": "--gpus-per-worker",
    "timeout_s": "--gloo-timeout-seconds",
    "placement_group_timeout_s": "--start-timeout",
    "nics": "--network-interfaces",
    "hosts": "-H/--hosts",
    "min_workers": "--min-np",
    "max_workers": "--max-np",
    "reset_limit": "--reset-limit",
    "cooldown_range": "--blacklist-cooldown-range",
    "elastic_timeout": "--elastic-timeout",
    "stall_timeout_s": "--stall-timeout-seconds",
}


def as_flag(err: Exception) -> str:
    """The executor's message, naming the flag instead of the Python parameter."""
    parameter = getattr(err, "parameter", None)
    flag = FLAG_OF.get(parameter)
    message = str(err)
    return message if flag is None else f"{flag}: {message}"


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(version("horovod"))
        parser.exit()


class _CheckBuild(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from horovod.runner.launch import check_build

        check_build(verbose=False)  # prints horovod's table, then exits


def resolve(args: argparse.Namespace) -> dict[str, str]:
    """Applies ``--config-file``, checks, refuses and warns; the HOROVOD_* variables the
    flags set (horovodrun's), for every rank.

    Raises:
        ValueError: A refused flag, a bad value or config file; names the flag.
    """
    from horovod.runner.common.util import config_parser

    if args.nic_list:
        args.nics = ",".join([*filter(None, [args.nics]), *args.nic_list])
    if args.config_file:
        config = _read_config(args.config_file)
        try:
            config_parser.set_args_from_config(args, config, getattr(args, OVERRIDES, set()))
        except ValueError as err:
            raise ValueError(f"--config-file {args.config_file}: {err}") from None
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag), None) not in (None, False):
            raise ValueError(f"{flag}: {why}")
    if args.log_level is not None and args.log_level not in config_parser.LOG_LEVELS:
        raise ValueError(f"--log-level: one of {', '.join(config_parser.LOG_LEVELS)}")
    try:
        config_parser.validate_config_args(args)
    except ValueError as err:
        raise ValueError(f"--{str(err).split('=')[0].replace('_', '-')}: {err}") from None
    for flag, why in IGNORED.items():
        if getattr(args, _dest(flag)) is not None:
            logger.warning("%s is ignored: %s", flag, why)
    env = config_parser.set_env_from_args({}, args)
    # Set from the job's own settings (create_settings' timeout_s), like every rank's.
    env.pop(config_parser.HOROVOD_GLOO_TIMEOUT_SECONDS, None)
    return env


def _dest(flag: str) -> str:
    named = {"--mpi": "use_mpi", "--jsrun": "use_jsrun"}
    return named.get(flag, flag.lstrip("-").replace("-", "_"))


def _read_config(path: str) -> dict:
    import yaml

    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config-file: cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config-file: {path} must hold a YAML mapping, got {config!r}")
    return config


def host_list(args: argparse.Namespace) -> list[tuple[str, int]] | None:
    """``-H``/``--hostfile`` as (host, ranks) pairs, cut to ``-np`` ranks in order as
    horovodrun fills its hosts; None when neither is given.

    Raises:
        ValueError: Both given, a malformed list or file, or ``-np`` above their slots.
    """
    from horovod.runner.common.util.hosts import parse_hosts_and_slots

    if args.hosts is None and args.hostfile is None:
        return None
    if args.hosts is not None and args.hostfile is not None:
        raise ValueError("-H/--hosts and --hostfile: give one of them")
    text = args.hosts if args.hostfile is None else _read_hostfile(args.hostfile)
    try:
        names, slots = parse_hosts_and_slots(text)
    except ValueError as err:
        raise ValueError(f"-H/--hosts {text!r}: {err}") from None
    pairs = [(name, slots[name]) for name in names]
    if args.num_proc is None:
        return pairs
    total = sum(n for _, n in pairs)
    if args.num_proc > total:
        raise ValueError(f"-np {args.num_proc} is more than the hosts' {total} slots")
    cut, left = [], args.num_proc
    for name, n in pairs:
        if left > 0:
            cut.append((name, min(n, left)))
            left -= min(n, left)
    return cut


def _read_hostfile(path: str) -> str:
    """horovodrun's host file (``HOST slots=N`` a line) as its ``-H`` string."""
    try:
        with open(path) as file:
            lines = [line.split() for line in file if line.strip()]
    except OSError as err:
        raise ValueError(f"--hostfile: cannot read {path}: {err}") from None
    entries = []
    for fields in lines:
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise ValueError(f"--hostfile {path}: each line is `HOST slots=N`, got {fields}")
        entries.append(f"{fields[0]}:{fields[1].removeprefix('slots=')}")
    return ",".join(entries)
