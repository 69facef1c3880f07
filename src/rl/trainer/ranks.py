"""torchrun for a host without GPUs: the trainer's ranks are forked from one process that has imported the trainer.

    python -m rl.trainer.ranks <torchrun's flags> -m rl.trainer.main <the trainer's flags>
    (or -m rl.trainer.service, `rl serve-api`'s trainer)

The command line is torchrun's, and so are the elastic agent, its rendezvous, restarts and shutdown
(`torch.distributed.run`'s flags and `elastic_launch`). What differs: torchrun execs a fresh Python per rank, which
imports torch, transformers and the trainer again; here the ranks are forked from this process after it imported
them once (the CPU saved: benchmarks/RESULTS.md, "Two lanes and forked trainer ranks").

Only where the trainer has no GPU (the launcher runs plain torchrun on GPUs): a process that touched CUDA must not
fork, and the imports are nothing beside a GPU host's cores and a model's loading there.
"""

from __future__ import annotations

import importlib
import os
import sys
import uuid

TRAINERS = ("rl.trainer.main", "rl.trainer.service")


def run_rank(module: str, *trainer_args: str) -> None:
    """A forked rank: the trainer's main() with its own flags (torchrun's environment is already set)."""
    import torch

    trainer = importlib.import_module(module)  # imported before the fork: a lookup
    if threads := os.environ.get("OMP_NUM_THREADS"):  # torchrun's 1 per rank: OpenMP read it before the fork
        torch.set_num_threads(int(threads))
    sys.argv = [module, *trainer_args]
    trainer.main()


def launch(argv: list[str]) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not (args.module and args.training_script in TRAINERS):
        sys.exit(f"rl.trainer.ranks: runs `-m {' ...` or `-m '.join(TRAINERS)} ...` only, not "
                 f"{args.training_script!r}")
    importlib.import_module(args.training_script)  # every rank's imports, once, before the fork

    # the rendezvous torchrun's run() picks for these flags: one node standalone or without an endpoint gets a
    # c10d store on a free local port and an id of its own; a static rendezvous keeps torchrun's default port
    single_node = torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and single_node):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = "fork"
    config, _, _ = torchrun.config_from_args(args)
    try:
        elastic_launch(config, run_rank)(args.training_script, *args.training_script_args)
    except ChildFailedError as e:  # torchrun's table of which rank failed how; exit 1, as torchrun
        sys.exit(f"rl.trainer.ranks: {e}")


def main() -> None:
    from rl.process import set_up_process

    set_up_process()  # this process imports the trainer too: its exit skips the final collection
    launch(sys.argv[1:])


if __name__ == "__main__":
    main()
