"""``horovod-ray run``: an unmodified horovodrun script, run on a Ray cluster.

``horovodrun -np 4 python train.py`` becomes ``horovod-ray run -np 4 python train.py``.
Every flag that horovodrun also has keeps horovodrun's name and meaning.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
from typing import Sequence

from horovod_ray.command import CommandJob, Output
from horovod_ray.errors import ConfigError, HorovodRayError
from horovod_ray.settings import MANAGED_ENV, create_settings

# The shell's convention for "ended by signal N", which horovodrun's users script against.
_SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
_USAGE_ERROR = 2

_DESCRIPTION = """\
Runs COMMAND as a Horovod job on Ray: one process per rank, each started by a Ray actor
with the rank's Horovod environment, so a script written for horovodrun runs unchanged.
Every line each rank writes is relayed with horovodrun's prefix ([RANK]<stdout>: or
[RANK]<stderr>:). The exit status is 0 when every rank exits 0, else the first failing
rank's status; Ctrl-C (130) or SIGTERM (143) ends every rank first.

Without --address (and without RAY_ADDRESS), a local Ray is started for the run, with at
least as many CPUs as the job asks for, and stopped at the end.
"""

_EPILOG = """\
examples:
  horovod-ray run -np 2 python train.py --epochs 3
  horovod-ray run --address auto --num-hosts 2 --slots-per-host 4 python train.py
  horovod-ray run -np 4 --output-filename logs --env TF_CPP_MIN_LOG_LEVEL=2 -- python train.py
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="horovod-ray",
        description="Horovod jobs on a Ray cluster.",
    )
    commands = parser.add_subparsers(dest="subcommand", metavar="run", required=True)
    run = commands.add_parser(
        "run",
        help="run a horovodrun-style command on Ray",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = run.add_argument_group("job size (give -np, or --num-hosts)")
    size.add_argument(
        "-np", "--num-proc", dest="num_proc", type=int, metavar="N",
        help="number of ranks, packed onto as few nodes as fit",
    )  # fmt: skip
    size.add_argument(
        "--num-hosts", type=int, metavar="H",
        help="number of nodes, each running --slots-per-host ranks (strictly spread)",
    )  # fmt: skip
    size.add_argument(
        "--slots-per-host", type=int, metavar="S", default=None,
        help="ranks per node with --num-hosts (default 1)",
    )  # fmt: skip
    ray_group = run.add_argument_group("Ray")
    ray_group.add_argument(
        "--address", metavar="ADDR",
        help="Ray cluster to join (host:port, 'auto', or ray://...); default: RAY_ADDRESS, "
        "else a local Ray started for this run",
    )  # fmt: skip
    ray_group.add_argument(
        "--cpus-per-worker", type=float, default=1, metavar="C",
        help="CPUs each rank reserves (default 1)",
    )  # fmt: skip
    ray_group.add_argument(
        "--gpus-per-worker", type=float, default=None, metavar="G",
        help="GPUs each rank reserves (default: none)",
    )  # fmt: skip
    ray_group.add_argument(
        "--working-dir", metavar="DIR",
        help="directory shipped to every node (Ray's runtime_env); ranks start in its copy",
    )  # fmt: skip
    horovod = run.add_argument_group("horovodrun's flags")
    horovod.add_argument(
        "--network-interfaces", dest="nics", metavar="IF,IF",
        help="network interfaces for Gloo, in order of preference: each node uses the "
        "first it has (e.g. 'eth0,ens5')",
    )  # fmt: skip
    horovod.add_argument(
        "--start-timeout", type=float, default=100, metavar="S",
        help="seconds Ray may take to place every rank (default 100)",
    )  # fmt: skip
    horovod.add_argument(
        "--gloo-timeout-seconds", type=float, default=120, metavar="S",
        help="seconds Gloo waits for peers (default 120)",
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
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]")
    return parser


class _UsageError(Exception):
    """A bad command line: reported with exit status 2, before Ray is touched."""


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise _UsageError(f"--env takes NAME=VALUE, got {pair!r}")
        if name in MANAGED_ENV:
            raise _UsageError(f"--env may not set {name}: horovod-ray sets it for each rank")
        env[name] = value
    return env


def _check_command(command: list[str]) -> list[str]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("give the COMMAND to run, e.g. `horovod-ray run -np 2 python train.py`")
    program = command[0]
    found = shutil.which(program)
    if found is None:
        raise _UsageError(
            f"command not found: {program!r} (not an executable file, nor on PATH); "
            f"check the spelling, or give its full path"
        )
    return command


def _build_executor(args: argparse.Namespace):
    from horovod_ray.executor import RayExecutor

    if args.num_proc is not None and args.num_hosts is not None:
        raise _UsageError("give -np or --num-hosts, not both")
    if args.num_proc is None and args.num_hosts is None:
        raise _UsageError("give the job's size: -np N, or --num-hosts H [--slots-per-host S]")
    if args.slots_per_host is not None and args.num_hosts is None:
        raise _UsageError("--slots-per-host needs --num-hosts")
    nics = None if args.nics is None else [nic for nic in args.nics.split(",") if nic]
    try:
        settings = create_settings(
            timeout_s=args.gloo_timeout_seconds,
            placement_group_timeout_s=args.start_timeout,
            nics=nics,
            verbose=2 if args.verbose else 1,
        )
        return RayExecutor(
            settings,
            num_workers=args.num_proc,
            num_hosts=args.num_hosts,
            num_workers_per_host=args.slots_per_host or 1,
            cpus_per_worker=args.cpus_per_worker,
            use_gpu=bool(args.gpus_per_worker),
            gpus_per_worker=args.gpus_per_worker or None,
            use_current_placement_group=False,
        )
    except ConfigError as err:
        raise _UsageError(_as_flag(err)) from err


_FLAG_OF = {
    "num_workers": "-np",
    "num_hosts": "--num-hosts",
    "num_workers_per_host": "--slots-per-host",
    "cpus_per_worker": "--cpus-per-worker",
    "gpus_per_worker": "--gpus-per-worker",
    "timeout_s": "--gloo-timeout-seconds",
    "placement_group_timeout_s": "--start-timeout",
    "nics": "--network-interfaces",
}


def _as_flag(err: ConfigError) -> str:
    """The executor's message, naming the flag instead of the Python parameter."""
    parameter = getattr(err, "parameter", None)
    flag = _FLAG_OF.get(parameter)
    message = str(err)
    return message if flag is None else f"{flag}: {message}"


class _Signals:
    """Turns the first Ctrl-C or SIGTERM into a request to stop; a second one interrupts."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> _Signals:
        self.install()
        return self

    def install(self) -> None:
        """(Re)installs the handlers: ``ray.init`` puts in its own for SIGTERM."""
        for signum in _SIGNAL_STATUS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _init_ray(args: argparse.Namespace, executor) -> bool:
    """Joins the cluster asked for, or starts a local Ray; True when it started one."""
    import ray

    options: dict = {
        "log_to_driver": args.verbose,
        "logging_level": logging.INFO if args.verbose else logging.WARNING,
    }
    if args.working_dir:
        options["runtime_env"] = {"working_dir": args.working_dir}
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **options)
        return False
    # Enough logical CPUs for the job, as horovodrun runs -np 4 on a 2-core machine.
    layout = executor.layout
    ranks = layout.num_workers or layout.num_hosts * layout.num_workers_per_host
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, math.ceil(ranks * layout.cpus_per_worker)),
        include_dashboard=False,
        **options,
    )
    return True


def run_command(args: argparse.Namespace) -> int:
    """``horovod-ray run``; returns the exit status."""
    try:
        command = _check_command(args.command)
        extra_env = _parse_env(args.env)
        executor = _build_executor(args)
        if args.working_dir and not os.path.isdir(args.working_dir):
            raise _UsageError(f"--working-dir: {args.working_dir!r} is not a directory")
        output = Output(sys.stdout, sys.stderr, args.output_filename)
        if args.output_filename:
            try:
                os.makedirs(args.output_filename, exist_ok=True)
            except OSError as err:
                raise _UsageError(f"--output-filename: cannot create it: {err}") from err
    except _UsageError as err:
        print(f"horovod-ray run: error: {err}", file=sys.stderr)
        return _USAGE_ERROR

    import ray

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="horovod-ray: %(message)s",
    )
    with _Signals() as signals:
        started_ray = _init_ray(args, executor)
        signals.install()
        job = CommandJob(executor, output, lambda: signals.received)
        try:
            executor.start()
            failed, stopped_by = job.run(
                command, dict(os.environ), extra_env, os.getcwd(), bool(args.working_dir)
            )
        except HorovodRayError as err:
            print(f"horovod-ray run: error: {err}", file=sys.stderr)
            return 1 if signals.received is None else _SIGNAL_STATUS[signals.received]
        finally:
            output.close()
            executor.stop()
            if started_ray:
                ray.shutdown()
    if stopped_by is not None:
        print(f"horovod-ray run: stopped by {signal.Signals(stopped_by).name}", file=sys.stderr)
        return _SIGNAL_STATUS[stopped_by]
    if failed is not None:
        where, done = job.where[failed], job.exits[failed]
        print(
            f"horovod-ray run: rank {failed} on {where.hostname} ({where.node_ip}) "
            f"{done.describe()}; the other ranks were stopped",
            file=sys.stderr,
        )
        return done.status
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``horovod-ray`` console script."""
    args = build_parser().parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
