"""What a job's start check costs before step 1, against one compile of the shrunk model.

    python bench/start_check_bench.py            # tiny_cpu (Llama) and a windowed Mistral on masked documents

On 2 local CPU ranks (gloo), after one throwaway compile, each case from cold compile caches
twice: the baseline is one
AutoSP step of the shrunk copy the check builds (compile, forward, backward: what any use of
that model pays); the check is `run_start_check` as a job runs it (the same step, the
single-device reference on rank 0, the comparison and its collectives), run first, so what
the process keeps from one compile to the next favours the baseline, not the check. Printed: both times
(rank 0's wall seconds), the check's extra seconds and its ratio to the baseline.
"""

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import spawn_ranks

from slurm_autosp.cluster.parallel_dims import ParallelDims, contiguous_parallel_dims
from slurm_autosp.compile import AutoSPBackend, compile_model
from slurm_autosp.config import DocumentBoundaries, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.model import build_model
from slurm_autosp.run_step import run_module_step
from slurm_autosp.sp import set_sp_groups
from slurm_autosp.sp.step import shard_for_rank
from slurm_autosp.verify import make_batch, shrink_model_config, verify_seq_len
from slurm_autosp.verify.start_check import _options, run_start_check

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml")
CASES = {
    "tiny_cpu (Llama)": ([], False),
    "Mistral, window, masked documents": (
        ["model.model_type=mistral", "model.extra={sliding_window: 4096}"],
        True,
    ),
}


def _baseline(cfg, dims: ParallelDims) -> None:
    """One AutoSP step of the shrunk copy the check builds, nothing compared."""
    options, _ = _options(cfg, dims)
    model_cfg = shrink_model_config(cfg.model, options)
    seq_len = verify_seq_len(dims.sp_size, options)
    batch = make_batch(options.rows, seq_len, model_cfg.vocab_size, options.seed)
    shard = shard_for_rank(dims, **batch)
    model = build_model(model_cfg)
    compile_model(model, AutoSPBackend(dims.sp_size), per_layer=cfg.compile.per_layer)
    set_sp_groups(dims.ulysses_group, dims.ring_group)
    run_module_step(model, [shard], dims.sp_size, dims.dp_size)


def _rank_main(rank: int, init_file: str, world_size: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    dims = contiguous_parallel_dims(world_size, 1, torch.device("cpu"))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        # a first compile in a process pays inductor's own start (imports, its C++ toolchain
        # probe): a throwaway one, so neither phase measures it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/cache_warm_up"
        _baseline(load_config([f"cfg={TINY}", f"run.output_root={tmp}/warm_up"]), dims)
        for name, (overrides, masked) in CASES.items():
            cfg = load_config([f"cfg={TINY}", f"run.output_root={tmp}/{len(rows)}", *overrides])
            if masked:
                cfg.data.documents = DocumentBoundaries.masked
            RunDir(cfg.run.dir).root.mkdir(parents=True, exist_ok=True)
            seconds = []
            for phase in (run_start_check, _baseline):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/cache_{len(rows)}_{phase.__name__}"
                torch._dynamo.reset()
                dist.barrier()
                start = time.perf_counter()
                phase(cfg, dims)
                dist.barrier()
                seconds.append(time.perf_counter() - start)
            rows[name] = seconds[::-1]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    world_size = 2
    rows = spawn_ranks(_rank_main, (world_size,), world_size)[0]
    print(f"start check on {world_size} CPU ranks (gloo), cold compile caches, rank 0's wall time")
    print(f"{'case':<36} {'one step (s)':>13} {'check (s)':>10} {'extra (s)':>10} {'ratio':>6}")
    for name, (baseline, check) in rows.items():
        print(
            f"{name:<36} {baseline:>13.1f} {check:>10.1f} {check - baseline:>10.1f} "
            f"{check / baseline:>6.2f}"
        )


if __name__ == "__main__":
    main()
