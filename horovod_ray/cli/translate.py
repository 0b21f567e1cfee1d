"""horovodrun's parsed flags as a job: the ranks' HOROVOD_* environment, the hosts, the
elastic bounds, and an error that names the flag rather than the Python parameter.

Each function reads the namespace ``flags`` defined and raises ``ValueError`` naming the
flag that does not fit, before Ray is touched.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from horovod_ray.cli.flags import IGNORED, OVERRIDES, REFUSED

logger = logging.getLogger(__name__)

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
    "storage_path": "--storage-path",
    "name": "--name",
    "checkpoint_config": "--num-to-keep",
    "timeline": "--timeline-filename",
}


def as_flag(err: Exception) -> str:
    """The executor's message, naming the flag instead of the Python parameter."""
    parameter = getattr(err, "parameter", None)
    flag = FLAG_OF.get(parameter)
    message = str(err)
    return message if flag is None else f"{flag}: {message}"


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
