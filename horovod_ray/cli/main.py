"""``horovod-ray run``: an unmodified horovodrun script, run on a Ray cluster.

``horovodrun -np 4 python train.py`` becomes ``horovod-ray run -np 4 python train.py``.
Every flag that horovodrun also has keeps horovodrun's name and meaning (``parser``,
``flags``). Here: the executor the flags ask for, the Ray it runs on, the attempts, and
the exit status.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import sys
import time
import types
from typing import Any, Sequence

from horovod_ray.checkpoints.spec import default_name
from horovod_ray.cli import rank_stacks, translate
from horovod_ray.cli.command import CommandJob
from horovod_ray.cli.elastic_command import run_elastic
from horovod_ray.cli.output import Output
from horovod_ray.cli.parser import build_parser
from horovod_ray.cli.signals import SIGNAL_STATUS, Signals
from horovod_ray.errors import ConfigError, WorkerFailedError
from horovod_ray.executor import RayExecutor
from horovod_ray.failures import restarts
from horovod_ray.settings import MANAGED_ENV, create_settings

_USAGE_ERROR = 2
_NO_ELASTIC_STACKS = "horovod-ray run: SIGUSR1 shows the stacks of static jobs only"


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


def _check_command(command: list[str], working_dir: str | None = None) -> list[str]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("give the COMMAND to run, e.g. `horovod-ray run -np 2 python train.py`")
    if working_dir is not None and not os.path.isdir(working_dir):
        raise _UsageError(f"--working-dir: {working_dir!r} is not a directory")
    program = command[0]
    if working_dir is not None and "/" in program and not os.path.isabs(program):
        # The ranks start in the shipped copy of the working directory.
        program = os.path.join(working_dir, program)
    found = shutil.which(program)
    if found is None:
        raise _UsageError(
            f"command not found: {program!r} (not an executable file, nor on PATH); "
            f"check the spelling, or give its full path"
        )
    return command


def _flag_or_env(value: float | None, variable: str, default: float) -> float:
    if value is not None:
        return value
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise _UsageError(f"{variable}={text!r} is not a number of seconds") from None


def _build_executor(args: argparse.Namespace) -> RayExecutor:
    try:
        hosts = translate.host_list(args)
        elastic = translate.elastic_options(args)
    except ValueError as err:
        raise _UsageError(str(err)) from None
    if args.max_restarts < 0:
        raise _UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.storage_path is not None and args.name is None:
        args.name = default_name()  # once: every attempt resumes from the same run
    if elastic is None:
        _check_static_size(args, hosts)
    elif args.max_restarts:
        raise _UsageError("--max-restarts: an elastic job recovers in place; drop one of them")
    nics = None if args.nics is None else [nic for nic in args.nics.split(",") if nic]
    job = elastic or {
        "num_workers": None if hosts else args.num_proc,
        "num_hosts": args.num_hosts,
        "hosts": hosts,
        "num_workers_per_host": 1 if args.slots_per_host is None else args.slots_per_host,
    }
    try:
        settings = create_settings(
            # As horovodrun: the flag, else the variable, else the default.
            timeout_s=_flag_or_env(args.gloo_timeout_seconds, "HOROVOD_GLOO_TIMEOUT_SECONDS", 120),
            placement_group_timeout_s=_flag_or_env(
                args.start_timeout, "HOROVOD_START_TIMEOUT", 100
            ),
            nics=nics,
            verbose=2 if args.verbose else 1,
            stall_timeout_s=args.stall_timeout_seconds,
            storage_path=args.storage_path,
            # The job's name; with a storage path, also its folder (named above).
            name=args.name or (None if args.storage_path else _job_name(args.command)),
            checkpoint_config=_checkpoint_config(args),
            # A static job's rank 0 writes it on its node, and the job brings it here as
            # it stops; an elastic job's ranks get HOROVOD_TIMELINE, as under horovodrun.
            timeline=args.timeline_filename if elastic is None else None,
        )
        return RayExecutor(
            settings,
            **job,
            cpus_per_worker=args.cpus_per_worker,
            # Given at all, it asks for GPUs: 0 is refused (leave the flag out for none).
            use_gpu=args.gpus_per_worker is not None,
            gpus_per_worker=args.gpus_per_worker,
            use_current_placement_group=False,
        )
    except ConfigError as err:
        raise _UsageError(translate.as_flag(err)) from err


def _job_name(command: list[str]) -> str | None:
    """The job's name without --name: its script's (``train.py``), else its program's."""
    words = [word for word in command if word != "--"]
    scripts = [os.path.basename(word) for word in words if word.endswith(".py")]
    return scripts[0] if scripts else os.path.basename(words[0]) if words else None


def _checkpoint_config(args: argparse.Namespace) -> object:
    """``--num-to-keep`` as a ``ray.train.CheckpointConfig`` would give it (without the
    seconds ray.train takes to import)."""
    if args.num_to_keep is None:
        return None
    return types.SimpleNamespace(
        num_to_keep=args.num_to_keep,
        checkpoint_score_attribute=None,
        checkpoint_score_order="max",
    )


def _check_static_size(args: argparse.Namespace, hosts: list | None) -> None:
    if hosts is not None and args.num_hosts is not None:
        raise _UsageError("give -H/--hostfile or --num-hosts, not both")
    if args.num_proc is not None and args.num_hosts is not None:
        raise _UsageError("give -np or --num-hosts, not both")
    if args.num_proc is None and args.num_hosts is None and hosts is None:
        raise _UsageError("give the job's size: -np N, or --num-hosts H [--slots-per-host S]")
    if args.slots_per_host is not None and args.num_hosts is None:
        raise _UsageError("--slots-per-host needs --num-hosts")


def _ray_address(args: argparse.Namespace) -> str | None:
    return args.address or os.environ.get("RAY_ADDRESS")


def _init_ray(args: argparse.Namespace, executor: RayExecutor) -> None:
    """Joins the cluster asked for, or starts a local Ray."""

    from horovod_ray import local_ray

    options: dict = {
        "log_to_driver": args.verbose,
        "logging_level": logging.INFO if args.verbose else logging.WARNING,
    }
    if args.working_dir:
        options["runtime_env"] = {"working_dir": args.working_dir}
    address = _ray_address(args)
    if address:
        local_ray.join(address, **options)
        return
    # Enough logical CPUs for the job, as horovodrun runs -np 4 on a 2-core machine.
    layout = executor.layout
    if layout.hosts is not None:
        ranks = sum(n for _, n in layout.hosts)
    else:
        ranks = layout.num_workers or layout.num_hosts * layout.num_workers_per_host
    if executor.elastic is not None:
        ranks = max(ranks, executor.elastic.max_workers or 0)
    local_ray.start(
        num_cpus=max(os.cpu_count() or 1, math.ceil(ranks * layout.cpus_per_worker)), **options
    )


def run_command(args: argparse.Namespace) -> int:
    """``horovod-ray run``; returns the exit status."""
    try:
        command, extra_env, executor, output = _prepare(args)
    except _UsageError as err:
        print(f"horovod-ray run: error: {err}", file=sys.stderr)
        return _USAGE_ERROR

    import ray

    from horovod_ray import local_ray

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="horovod-ray: %(message)s",
    )
    for stream in (sys.stdout, sys.stderr):
        # A rank's text must never fail the run on a terminal that cannot show it.
        stream.reconfigure(errors="backslashreplace")
    starts_local_ray = _ray_address(args) is None
    outcome: dict[str, Any] = {"job": None, "failed": None, "error": None}
    with Signals() as signals:
        try:
            try:
                _init_ray(args, executor)
            except SystemExit as exit_:
                # Ray's own SIGTERM handler, in place while ray.init runs.
                if exit_.code != signal.SIGTERM:
                    raise
                signals.received = signal.SIGTERM
            signals.install()
            run = (command, dict(os.environ), extra_env, os.getcwd(), bool(args.working_dir))
            _attempts(args, executor, run, output, signals, outcome)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: the ranks were ended the hard way (see rank_guard)
        except Exception as err:  # noqa: BLE001 - one line for the user, not a traceback
            outcome["error"] = err
        finally:
            output.close()
            if starts_local_ray and ray.is_initialized():
                local_ray.stop()
    return _exit_status(signals.received, outcome["error"], outcome["failed"], outcome["job"])


def _attempts(args, executor, run: tuple, output: Output, signals: Signals, outcome: dict):
    """The job, then (``--max-restarts``) a new one after each failure, with a back-off
    that a signal cuts short (``restarts.attempts``); ``outcome`` holds the last attempt's
    job, failing rank and error."""
    executors = iter([executor])

    def attempt(number: int) -> None:
        # The first attempt's executor was built (and checked) before Ray started.
        executor = next(executors, None) or _build_executor(args)
        signals.no_stacks_note = _NO_ELASTIC_STACKS if executor.elastic is not None else None
        job = outcome["job"] = CommandJob(
            executor, output, rank_stacks.after_poll(executor, signals)
        )
        outcome["failed"] = outcome["error"] = None
        env = {**run[2], restarts.ATTEMPT_ENV: str(number)}
        try:
            if signals.received is None:
                signals.on_signal = executor.stop  # a start waiting for room gives up
                executor.start()
                signals.on_signal = None
            if signals.received is None and executor.elastic is not None:
                signals.on_signal = executor.stop  # the run ends, and raises
                run_elastic(executor, output, run[0], run[1], env, *run[3:])
            elif signals.received is None:
                outcome["failed"] = job.run(run[0], run[1], env, *run[3:])
        except WorkerFailedError as err:
            outcome["error"] = err
        finally:
            executor.stop()
        if signals.received is not None:
            return  # stopped: no restart, whatever the ranks did
        if outcome["failed"] is not None:
            cause = _rank_failure(job, outcome["failed"])
            raise WorkerFailedError({outcome["failed"]: cause}, cause)
        if outcome["error"] is not None:
            raise outcome["error"]

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while signals.received is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return signals.received is None

    def tell(number: int, failure: BaseException, wait_s: float, left: int) -> None:
        print(
            f"horovod-ray run: attempt {number} failed ({failure}); restarting in "
            f"{wait_s:g}s ({left} restarts left)",
            file=sys.stderr,
        )

    try:
        restarts.attempts(
            restarts.RestartPolicy(args.max_restarts), attempt, wait=wait, on_restart=tell
        )
    except WorkerFailedError:
        pass  # the last attempt's failure is in outcome, for the exit status


def _prepare(args: argparse.Namespace) -> tuple[list[str], dict[str, str], Any, Output]:
    """Everything checked before Ray: the command, the ranks' extra environment, the
    executor and the output; _UsageError for what is wrong."""
    try:
        tuning = translate.resolve(args)
    except ValueError as err:
        raise _UsageError(str(err)) from None
    command = _check_command(args.command, args.working_dir)
    executor = _build_executor(args)
    if executor.settings.timeline is not None:
        tuning.pop("HOROVOD_TIMELINE", None)  # rank 0's own file (see _build_executor)
    extra_env = {**tuning, **_parse_env(args.env)}
    if args.nics:
        # As horovodrun: NCCL (GPU collectives) uses the same interfaces.
        extra_env.setdefault("NCCL_SOCKET_IFNAME", args.nics)
    output = Output(sys.stdout, sys.stderr, args.output_filename, args.prefix_output_with_timestamp)
    if args.output_filename:
        try:
            os.makedirs(args.output_filename, exist_ok=True)
        except OSError as err:
            raise _UsageError(f"--output-filename: cannot create it: {err}") from err
    return command, extra_env, executor, output


def _exit_status(
    received: int | None, error: Exception | None, failed: int | None, job: CommandJob
) -> int:
    """The run's exit status, with one line on stderr for anything but success."""
    if received is not None:
        name = signal.Signals(received).name
        print(f"horovod-ray run: stopped by {name}", file=sys.stderr)
        return SIGNAL_STATUS[received]
    if isinstance(error, ConfigError):
        # Found once Ray was there to ask (a host that is no node): still a bad command line.
        print(f"horovod-ray run: error: {translate.as_flag(error)}", file=sys.stderr)
        return _USAGE_ERROR
    if error is not None:
        print(f"horovod-ray run: error: {error}", file=sys.stderr)
        return 1
    if failed is not None:
        print(f"horovod-ray run: {_rank_failure(job, failed)}", file=sys.stderr)
        return job.exits[failed].status
    return 0


def _rank_failure(job: CommandJob, failed: int) -> str:
    where, done = job.where[failed], job.exits[failed]
    return (
        f"rank {failed} on {where.hostname} ({where.node_ip}) {done.describe()}; the other "
        f"ranks were stopped"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The ``horovod-ray`` console script."""
    args = build_parser().parse_args(argv)
    if args.subcommand == "status":
        from horovod_ray.cli.status import status_command

        return status_command(args)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
