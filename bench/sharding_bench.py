"""Parameter sharding (zero_stage=3, FSDP2) against ZeRO-1 (zero_stage=1, DeepSpeed): step time and
the memory each rank holds, one model, one batch stream, one invocation.

    python bench/sharding_bench.py                          # tiny Llama (hidden 64, 2 layers), seq 512
    python bench/sharding_bench.py --hidden 256 --layers 4 --seq 2048 --steps 20

Both stages run the production path on 2 ranks, SP=2 (so the sharding group is the SP group):
`build_engine(cfg, device, stage)`, `compile_for_sp` (per-layer AutoSP, SAC budget 1 on both so
both compile the same policy), then `train.optimizer_step` (synthetic data, `prepare_sp_inputs`,
`causal_lm_loss`, the engine's loss scale, backward, step). Ranks are CPU processes with gloo and
fp32, or, with at least 2 GPUs, one GPU per rank with NCCL and the job's default bf16. Each stage
runs in its own spawned process group with a fresh inductor cache (both compile cold):
DeepSpeed keeps process-wide state (accelerator, logger, comm) that would otherwise carry over.
About 1.5-2 minutes on 2 CPU cores, most of it the two cold compiles; on a shared machine the step
times (and their ratio) move with other load, the memory columns do not.

Columns (times: the slower rank; memory: the rank holding more state):
- build: the engine built (model, sharding, optimizer); compile+1st: compile_for_sp and the first
  optimizer step, compilation included; step: median of --steps timed steps after the first step
  and --warmup untimed ones; tok/s: the step's tokens over all ranks / median step.
- held state, at the last warmup step's optimizer step (after backward, before the update, Adam
  state already created): distinct tensor storages (views counted once, DTensors by their local
  shard, alignment padding included, meta tensors not), each under the first role that reaches it:
  weights: the module's parameters (ZeRO-1: the whole model, in DeepSpeed's flat buffer; FSDP2:
  the rank's fp32 shard, which is also its master copy); grads: each parameter's .grad and any
  tensor DeepSpeed hangs on it (`grad_accum`), plus ZeRO-1's reduced gradient partition
  (`optimizer.averaged_gradients`); master: ZeRO-1's fp32 master partition
  (`optimizer.single_partition_of_fp32_groups`, a copy even in fp32); Adam: exp_avg, exp_avg_sq
  and step of the torch AdamW; other: any further tensor the DeepSpeed optimizer holds (bucket
  buffers, scalars). FSDP2 holds nothing outside its parameters and its AdamW. Not in these columns:
  transients, e.g. ZeRO-1's whole-model gradients between backward and their reduction at its
  end, FSDP2's gathered layers; they are in the peak columns.
- peak RSS+ (CPU): the process's peak resident set (VmHWM, reset at the start) minus its resident
  set before the engine is built: model, compiler and activations included, imports not.
  peak alloc (GPU): torch.cuda.max_memory_allocated over the run.
- loss: the last step's global loss. The two runs do not start from the same weights (FSDP2 builds
  the model on the meta device and initialises each shard), so the losses are close, not equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import bench_parser

WORLD = 2
STAGES = {1: "DeepSpeed ZeRO-1", 3: "FSDP2 (params sharded)"}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _tensors(obj: Any) -> Iterator[Any]:
    """Every tensor (and its .grad) inside nested containers and torch optimizers."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(key)
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, torch.optim.Optimizer):
        yield from _tensors(obj.state)
        yield from _tensors(obj.param_groups)


def held_state(engine: Any) -> dict[str, int]:
    """Bytes of distinct storages by role, each storage counted once, in the order below."""
    from torch.distributed.tensor import DTensor

    from slurm_autosp.engine import ZeRO1Engine

    seen: set[int] = set()

    def add(tensors: Iterator[Any]) -> int:
        total = 0
        for t in tensors:
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if not t.is_meta and storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(engine.module.parameters())
    deepspeed = engine._engine.optimizer if isinstance(engine, ZeRO1Engine) else None
    optimizer = deepspeed.optimizer if deepspeed else engine.optimizer  # the torch AdamW
    held = {
        "weights": add(iter(params)),
        "grads": add(
            _tensors(
                [
                    [[p.grad, *vars(p).values()] for p in params],
                    getattr(deepspeed, "averaged_gradients", None),
                ]
            )
        ),
        "master": add(_tensors(getattr(deepspeed, "single_partition_of_fp32_groups", None))),
        "adam": add(_tensors(list(optimizer.state.values()))),
        "other": add(_tensors(vars(deepspeed))) if deepspeed else 0,
    }
    held["total"] = sum(held.values())
    return held


def run_stage(rank: int, stage: int, args: argparse.Namespace, init_file: str, out: str) -> None:
    use_gpus = args.device == "cuda"
    os.environ["LOCAL_RANK"] = str(rank)
    if not use_gpus:
        os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import deepspeed  # imported by both stages, before the baseline
    import torch
    import torch.distributed as dist

    from slurm_autosp.cluster.parallel_dims import build_parallel_dims
    from slurm_autosp.config import load_config
    from slurm_autosp.data import build_source
    from slurm_autosp.memory_plan import activation_checkpoint_spec_for
    from slurm_autosp.train import build_engine, compile_for_sp, optimizer_step

    deepspeed.utils.logger.setLevel("WARNING")
    device = torch.device("cuda", rank) if use_gpus else torch.device("cpu")
    if use_gpus:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if use_gpus else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        device_id=device if use_gpus else None,
    )
    h = args.hidden
    cfg = load_config(
        [
            f"run.output_root={Path(init_file).parent}",
            f"cluster.tasks_per_node={WORLD}",
            f"cluster.gpus_per_node={WORLD if use_gpus else 0}",
            f"model.hidden_size={h}",
            f"model.intermediate_size={2 * h}",
            f"model.num_hidden_layers={args.layers}",
            f"data.seq_len={args.seq}",
            f"parallel.sp_size={WORLD}",
            f"parallel.zero_stage={stage}",
            "compile.enabled=true",
            "compile.activation_checkpointing=sac",
            "compile.activation_memory_budget=1.0",
            f"train.steps={1 + args.warmup + args.steps}",
            "train.seed=0",
        ]
    )
    dims, source = build_parallel_dims(cfg, local_rank=rank, device=device), build_source(cfg)

    def say(message: str) -> None:
        if rank == 0:
            print(f"[stage {stage}] {message}", file=sys.stderr, flush=True)

    baseline = _status_bytes("VmRSS")
    try:  # writing 5 resets the peak resident set (VmHWM) to the current one
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if use_gpus:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.train.seed)
    start = time.perf_counter()
    engine = build_engine(cfg, device, stage)
    built = time.perf_counter()
    say(f"{type(engine).__name__} built in {built - start:.1f} s; compiling (first step)")
    backend = compile_for_sp(engine.module, cfg.compile, dims, activation_checkpoint_spec_for(cfg))
    held: dict[str, int] = {}
    real_step = engine.step

    def step_and_measure() -> None:  # the held state, just before the last warmup step's update
        if step == args.warmup:
            held.update(held_state(engine))
        real_step()

    engine.step = step_and_measure
    times, losses, compiled = [], [], 0.0
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        losses.append(optimizer_step(engine, cfg, dims, source, step))
        times.append(time.perf_counter() - t0)
        if step == 0:
            assert backend is not None
            backend.require_sdpa_found()
            compiled = time.perf_counter() - built
            say(f"compile + first step {compiled:.1f} s, loss {losses[0]:.4f}")
        elif step > args.warmup:
            say(
                f"step {step - args.warmup}/{args.steps}: {1e3 * times[-1]:.1f} ms, loss {losses[-1]:.4f}"
            )
    mine = {
        "build_s": built - start,
        "compile_first_s": compiled,
        "step_s": statistics.median(times[1 + args.warmup :]),
        "loss": losses[-1],
        "held": held,
        "peak_rss": _status_bytes("VmHWM") - baseline,
        "peak_alloc": torch.cuda.max_memory_allocated(device) if use_gpus else None,
        "tokens": args.seq * cfg.global_batch,
        "precision": cfg.precision.value,
    }
    engine.close()
    gathered: list[dict[str, Any]] = [{} for _ in range(WORLD)]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def render(results: dict[int, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    first = results[1][0]
    memory = "peak alloc" if args.device == "cuda" else "peak RSS+"
    lines = [
        f"Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, SP={WORLD} on {WORLD} {args.device} "
        f"ranks, {first['precision']}, compiled per layer; {args.steps} timed steps after {args.warmup} warmup",
        "",
        f"| stage | engine | build s | compile+1st s | step ms | tok/s | weights | grads | master | Adam "
        f"| other | held total | {memory} | final loss |",
        "|---|---|" + "---:|" * 12,
    ]
    row: dict[int, dict[str, Any]] = {}
    for stage, ranks in results.items():
        held = max((r["held"] for r in ranks), key=lambda h: h["total"])
        peak = max(r["peak_alloc"] if args.device == "cuda" else r["peak_rss"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        row[stage] = {"step": step, "held": held["total"]}
        lines.append(
            f"| {stage} | {STAGES[stage]} | {max(r['build_s'] for r in ranks):.1f} "
            f"| {max(r['compile_first_s'] for r in ranks):.1f} | {1e3 * step:.1f} | {ranks[0]['tokens'] / step:,.0f} "
            + "".join(
                f"| {_size(held[k])} "
                for k in ("weights", "grads", "master", "adam", "other", "total")
            )
            + f"| {_size(peak)} | {ranks[0]['loss']:.4f} |"
        )
    lines += [
        "",
        f"stage 3 / stage 1: step time x{row[3]['step'] / row[1]['step']:.2f}, "
        f"held state x{row[3]['held'] / row[1]['held']:.2f}",
        "final losses differ a little because the runs start from different initial weights (stage 3 "
        "initialises its shards from a meta-device model); same data, same schedule.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--hidden",
        type=int,
        default=64,
        help="hidden size (intermediate = 2x; 4 heads, 2 KV heads)",
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument(
        "--seq", type=int, default=512, help="tokens per sequence (one sequence per step)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per stage")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps after the first (>= 1)"
    )
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the held state is measured on the last warmup step")
    import torch
    import torch.multiprocessing as mp

    from slurm_autosp.cluster.compile_cache import use_private_compile_cache

    args.device = "cuda" if torch.cuda.device_count() >= WORLD else "cpu"
    results: dict[int, list[dict[str, Any]]] = {}
    for stage in STAGES:
        with tempfile.TemporaryDirectory(prefix="sharding_bench_") as tmp:
            use_private_compile_cache(os.path.join(tmp, "cache"), inherited={})  # both cold
            out = os.path.join(tmp, "result.json")
            mp.spawn(run_stage, args=(stage, args, os.path.join(tmp, "store"), out), nprocs=WORLD)
            results[stage] = json.loads(Path(out).read_text())
    print(render(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
