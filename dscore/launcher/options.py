"""Command-line options of ``dscore run`` (DeepSpeed's ``deepspeed`` launcher flags, same names and meaning).

Differences from DeepSpeed: ``-H`` defaults to ``None`` meaning the implicit ``/job/hostfile`` (so an
explicitly passed missing hostfile can be an error); ``--nproc_per_node`` is an alias of ``--num_gpus``
(torchrun's name); ``--launcher`` also accepts ``ssh`` and any back end a plugin registers (its default,
``None``, means the registered default back end, pdsh); ``--dry_run [--json]`` prints the plan; argparse
abbreviations are off (``dscore`` builds its parsers with ``allow_abbrev=False``), so a misspelled
launcher option is an error instead of silently matching another one. ``--local_rank_spelling local-rank``
(dscore only) passes torchrun's ``--local-rank=N`` instead of ``--local_rank=N``.
"""

from __future__ import annotations

import argparse

from dscore.launcher.hostfile import DEFAULT_HOSTFILE
from dscore.launcher.ranks import LOCAL_RANK_SPELLINGS
from dscore.launcher.runners import launcher_names

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the launcher options, the positional ``user_script`` and the remaining ``user_args``."""
    g = parser.add_argument_group("resources")
    g.add_argument(
        "-H",
        "--hostfile",
        default=None,
        metavar="PATH",
        help=f"MPI-style hostfile ('host slots=N' lines); default {DEFAULT_HOSTFILE}, which may be missing "
        "(then local resources are used) - an explicitly given file must exist",
    )
    g.add_argument("-i", "--include", default="", metavar="FILTER", help="host[:slot,slot][@host...] to use")
    g.add_argument("-e", "--exclude", default="", metavar="FILTER", help="host[:slot,slot][@host...] to leave out")
    g.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    g.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--nproc_per_node",
        dest="num_gpus",
        type=int,
        default=-1,
        help="processes per node (slots 0..N-1 on every host); any accelerator, CPU included",
    )
    g = parser.add_argument_group("rendezvous")
    g.add_argument(
        "--master_addr", default="", help="address of rank 0 (default: 127.0.0.1 locally, the first host otherwise)"
    )
    g.add_argument(
        "--master_port",
        type=int,
        default=None,
        help="TCP port of rank 0 (default: a free port for a single-node run, logged; 29500 across nodes). "
        "An explicit port that is busy fails before any rank starts",
    )
    g.add_argument("--node_rank", type=int, default=-1, help="this node's index in the hostfile (with --no_ssh)")
    g.add_argument(
        "--no_ssh", action="store_true", help="start only this node's ranks (run once per node, torchrun-like)"
    )
    g.add_argument(
        "--no_ssh_check",
        action="store_true",
        help="accepted for DeepSpeed compatibility (dscore never probes hosts with ssh)",
    )
    g = parser.add_argument_group("multi-node backend")
    g.add_argument(
        "--launcher",
        default=None,
        type=str.lower,
        metavar="NAME",
        help=f"multi-node backend registered by a plugin: {', '.join(launcher_names())} (default: the one "
        "registered as default, pdsh; case-insensitive)",
    )
    g.add_argument("--launcher_args", default="", help="extra arguments for the backend command (shell-split)")
    g.add_argument("--force_multi", action="store_true", help="use the multi-node backend even for one host")
    g.add_argument("--ssh_port", type=int, default=None, help="ssh port for pdsh/ssh")
    g.add_argument("--venv_script", default=None, help="script sourced on every node before the ranks start (every runner but impi)")
    g = parser.add_argument_group("processes")
    g.add_argument("--module", action="store_true", help="run user_script as a module (python -m)")
    g.add_argument("--no_python", action="store_true", help="run user_script directly, not through python")
    g.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    g.add_argument(
        "--local_rank_spelling",
        choices=LOCAL_RANK_SPELLINGS,
        default="local_rank",
        help="how the script's local-rank argument is spelled: local_rank (--local_rank=N, DeepSpeed's) or "
        "local-rank (--local-rank=N, torchrun's since torch 2.0); dscore only, DeepSpeed has no such option",
    )
    g.add_argument(
        "--save_pid", action="store_true", help="write the launcher pid to <tmp>/<pid>.deepspeed while running"
    )
    g.add_argument(
        "--enable_each_rank_log", default=None, metavar="DIR", help="write each rank's output to DIR/<time>_rank<R>.log"
    )
    g.add_argument(
        "--bind_cores_to_rank", action="store_true", help="bind each rank to its share of the cores (numactl)"
    )
    g.add_argument("--bind_core_list", default=None, metavar="LIST", help="cores to share out, e.g. 0,2-4,6")
    g = parser.add_argument_group("output")
    g.add_argument("--dry_run", action="store_true", help="print the launch plan and start nothing")
    g.add_argument("--json", action="store_true", help="with --dry_run: print the plan as JSON")
    g.add_argument("-q", "--quiet", action="store_true", help="only log errors (same as --log_level error)")
    g.add_argument(
        "--log_level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="launcher log level",
    )
    parser.add_argument("user_script", help="training script (or module with --module, program with --no_python)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script, unchanged")
