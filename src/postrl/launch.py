"""Multi-process CPU launches.

``accelerate launch --cpu --num_processes 2 -m postrl train ...`` starts ONE process: accelerate runs multi-CPU
jobs only through ``mpirun`` (``--mpirun_hostfile``); without it, its simple launcher sets ``MASTER_ADDR`` /
``MASTER_PORT`` and runs the script once. A user who asked for 2 processes would silently train on one.
postrl detects that case (accelerate's CPU launch, a master address, no rank variables), reads the requested
``--num_processes`` from the launcher's command line and starts the workers itself with
``torch.distributed.run`` (each worker: DDP over gloo, as accelerate would set up). Where the count cannot be
read, it stops with a one-line error that gives the command that works (``torchrun --nproc_per_node N``).
"""

from __future__ import annotations

import os
import sys

from postrl.errors import PostrlError

_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE")


def _requested_processes(cmdline: list[str]) -> int | None:
    for i, arg in enumerate(cmdline):
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(cmdline):
            return int(cmdline[i + 1])
        if arg.startswith(("--num_processes=", "--num-processes=")):
            return int(arg.split("=", 1)[1])
    return None


def _parent_cmdline() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def relaunch_if_needed(argv: list[str]) -> int | None:
    """If this process is a lone worker of ``accelerate launch --cpu --num_processes N`` (N > 1), run the command
    in N workers and return their exit status; else None (carry on in this process)."""
    env = os.environ
    if env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1"):
        return None
    # --cpu on a machine with GPUs: hide them from this process and its workers (before CUDA is initialised), or
    # the gloo process group's barrier takes device cuda:<rank> ("invalid device ordinal" on a 1-GPU machine).
    env["CUDA_VISIBLE_DEVICES"] = ""
    if "MASTER_ADDR" not in env:
        return None
    if any(v in env for v in _RANK_VARS) or env.get("POSTRL_NO_RELAUNCH"):
        return None
    parent = _parent_cmdline()
    n = _requested_processes(parent)
    if n is None:
        if not any("accelerate" in a for a in parent):
            return None
        raise PostrlError("accelerate launch --cpu started one process and the requested --num_processes could not "
                          "be read; use `torchrun --nproc_per_node N -m postrl ...`")
    if n <= 1:
        return None
    from torch.distributed import run as torchrun

    port = env.get("MASTER_PORT", "29500")
    args = ["--nproc_per_node", str(n), "--master_addr", env["MASTER_ADDR"], "--master_port", port,
            "-m", "postrl", *argv]
    try:
        torchrun.main(args)
    except SystemExit as e:  # torchrun exits with the workers' status
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - a worker failed: torchrun raises ChildFailedError
        print(f"postrl: error: a worker process failed ({type(e).__name__})", file=sys.stderr)
        return 1
    return 0
