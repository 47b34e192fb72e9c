"""Run a bench's ranks as spawned processes over one gloo file store and collect what each
rank wrote: shared by the benches that measure SP ranks on this machine."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(rank_main: Callable[..., None], args: tuple, nprocs: int) -> list[Any]:
    """Call `rank_main(rank, init_file, *args, out)` on `nprocs` spawned ranks, each of which
    writes its JSON result to f"{out}.{rank}"; return those results in rank order. The ranks
    compile into fresh private caches (inductor's and Triton's), so no run times another's
    cached graphs."""
    from slurm_autosp.cluster.compile_cache import use_private_compile_cache

    with tempfile.TemporaryDirectory() as tmp:
        use_private_compile_cache(os.path.join(tmp, "cache"), inherited={})
        out = os.path.join(tmp, "rows")
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), *args, out), nprocs=nprocs)
        return [json.loads(open(f"{out}.{rank}").read()) for rank in range(nprocs)]
