"""``horovod-ray``'s parser: the job's size, Ray's flags, then horovodrun's (``flags``).

Parsing touches nothing: a bad command line exits 2 before Ray is imported.
"""

from __future__ import annotations

import argparse

from horovod_ray.cli import flags
from horovod_ray.settings import STALL_TIMEOUT_S

_DESCRIPTION = """\
Runs COMMAND as a Horovod job on Ray: one process per rank, each started by a Ray actor
with the rank's Horovod environment, so a script written for horovodrun runs unchanged.
Every line each rank writes is relayed with horovodrun's prefix ([RANK]<stdout>: or
[RANK]<stderr>:). The exit status is 0 when every rank exits 0, else the first failing
rank's status; Ctrl-C (130) or SIGTERM (143) ends every rank first. SIGUSR1 prints
every rank's Python stacks to stderr (read with py-spy), and the run goes on.

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
        prog="horovod-ray", description="Horovod jobs on a Ray cluster.", allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="subcommand", metavar="{run,status}", required=True)
    run = commands.add_parser(
        "run",
        help="run a horovodrun-style command on Ray",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # horovodrun's --gloo must not read as an abbreviation of --gloo-timeout-seconds.
        allow_abbrev=False,
    )
    _add_size_flags(run)
    _add_ray_flags(run)
    flags.add_horovod_flags(run)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]")
    status = commands.add_parser(
        "status",
        help="list the horovod_ray jobs running on a Ray cluster",
        description="Lists the horovod_ray jobs on the Ray cluster (from Ray's GCS): name, "
        "id, state, ranks, restarts, the last report's step and age, and the slowest rank "
        "(the one the others waited for longest).",
    )
    status.add_argument(
        "--address",
        default=None,
        help="the cluster's address (default: RAY_ADDRESS, else the cluster on this machine)",
    )
    status.add_argument("--json", action="store_true", help="one JSON list, for scripts")
    status.add_argument(
        "--all", action="store_true", help="also the jobs that ended (stopped, failed, lost)"
    )
    return parser


def _add_size_flags(run: argparse.ArgumentParser) -> None:
    size = run.add_argument_group("job size (give -np, or --num-hosts)")
    size.add_argument(
        "-np",
        "--num-proc",
        dest="num_proc",
        type=int,
        metavar="N",
        help="number of ranks, packed onto as few nodes as fit",
    )
    size.add_argument(
        "--num-hosts",
        type=int,
        metavar="H",
        help="number of nodes, each running --slots-per-host ranks (strictly spread)",
    )
    size.add_argument(
        "--slots-per-host",
        type=int,
        metavar="S",
        default=None,
        help="ranks per node with --num-hosts (default 1)",
    )


def _add_checkpoint_flags(run: argparse.ArgumentParser) -> None:
    group = run.add_argument_group(
        "checkpoints (a Python command's horovod_ray.report / get_checkpoint)"
    )
    group.add_argument(
        "--storage-path",
        metavar="PATH",
        help="folder or URI (s3://bucket/runs) where rank 0's reported checkpoints persist; "
        "each attempt, and a later run with the same --name, resumes from the latest",
    )
    group.add_argument(
        "--name",
        metavar="NAME",
        help="the job's name in its metrics and `horovod-ray status`; with --storage-path also "
        "its folder there (default: one made from the time)",
    )
    group.add_argument(
        "--num-to-keep",
        type=int,
        metavar="N",
        help="checkpoints kept: the N newest (default: all)",
    )


def _add_ray_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--stall-timeout-seconds",
        type=float,
        default=STALL_TIMEOUT_S,
        metavar="S",
        help="seconds ranks may wait in a collective another rank never enters before "
        f"horovod shuts the job down (default {STALL_TIMEOUT_S:g}; 0: off)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a rank fails, run the job again as a new one, up to N times, waiting "
        "1 s, 2 s, 4 s, ... (at most 60 s) between; HOROVOD_RAY_ATTEMPT holds the attempt",
    )
    _add_checkpoint_flags(run)
    ray_group = run.add_argument_group("Ray")
    ray_group.add_argument(
        "--address",
        metavar="ADDR",
        help="Ray cluster to join (host:port, 'auto', or ray://...); default: RAY_ADDRESS, "
        "else a local Ray started for this run",
    )
    ray_group.add_argument(
        "--cpus-per-worker",
        type=float,
        default=1,
        metavar="C",
        help="CPUs each rank reserves (default 1)",
    )
    ray_group.add_argument(
        "--gpus-per-worker",
        type=float,
        default=None,
        metavar="G",
        help="GPUs each rank reserves (default: none)",
    )
    ray_group.add_argument(
        "--working-dir",
        metavar="DIR",
        help="directory shipped to every node (Ray's runtime_env); ranks start in its copy",
    )
