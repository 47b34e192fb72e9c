"""Sequence tiling and activation offload, measured per rank on our AutoSP graphs (SP=2), with
the memory plan's prediction beside each figure.

    python bench/context_bench.py                     # S = 16384 over 2 CPU ranks
    python bench/context_bench.py --seq 8192 --steps 3

A tiny Llama whose MLP is wide (hidden 64, intermediate 1024 = 16x, 4 heads, 2 KV heads, 2
layers, fp32), its decoder layers compiled per layer by our backend with SAC at budget 0 (the
production policy for long sequences), run as a decoder stack (embedding and rotary outside
autograd, loss = sum of the last hidden state) on one sequence of S tokens over 2 CPU ranks
(gloo). Modes: untiled; MLP tiled (compile.tile_tokens); tiled and offloaded
(compile.offload_activations, every saved tensor moved); then under `full` checkpointing with
the all-to-alls recomputed: untiled; whole layers tiled (compile.tiled_layer); tiled layers
offloaded. Columns, per rank (rank 0):
- held for bw: bytes of distinct storages saved for backward, parameters excluded
  (saved_tensors_hooks); offloaded: what the offload left on the device plus the peak of its
  device copies alive at once (fetched ahead or in the backward's hands);
- largest saved: the largest of them;
- peak working: the resident-set peak during forward+backward above the resident set before
  it (VmHWM after clear_refs), glibc's mmap threshold at 64 KiB so freed tensors leave at once;
  on CPU the offloaded copies live in the same memory, so this column does not fall with offload;
- step: median wall time of forward+backward;
- moved/layer, resident: offload's bytes to host per layer per step, and its peak of fetched copies;
- plan: the plan's activations for this mode (layers x the traced layer's saved bytes + the
  shared cos/sin; offloaded: two layers' worth), its largest saved tensor and its working bytes
  (LayerTrace.working_bytes_with: the traced peak plus one tile's working set for tiled MLPs;
  for tiled layers, from plan.layer_graph.tiled_layer_trace, the larger of the full-width peak
  and what lives beside a tile plus the tile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import bench_parser

SP = 2
LAYERS = 2
MODES = [
    "untiled",
    "tiled",
    "tiled_offloaded",
    "full",
    "full_tiled_layers",
    "full_tiled_layers_offloaded",
]


def model_config():
    from slurm_autosp.config import ModelConfig

    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def run_mode(mode: str, seq: int, tile: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.compile.hf_attention import use_sp_attention
    from slurm_autosp.model import build_model
    from slurm_autosp.sp import set_sp_group
    from slurm_autosp.sp.offload import ActivationOffload

    torch.manual_seed(0)
    model = build_model(model_config())
    use_sp_attention(model)
    backend = AutoSPBackend(SP, _spec(mode))
    tiled = "tiled" in mode.split("_")  # not "untiled"
    compile_model(model, backend, per_layer=True, tile_tokens=tile if tiled else 0)
    set_sp_group(dist.group.WORLD)
    rank, local = dist.get_rank(), seq // SP
    offload = (
        ActivationOffload("cpu", layers=LAYERS, min_bytes=0) if mode.endswith("offloaded") else None
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))[
        :, rank * local : (rank + 1) * local
    ]
    position_ids = torch.arange(rank * local, (rank + 1) * local).unsqueeze(0)
    with torch.no_grad():
        embedded = model.model.embed_tokens(ids)
        rotary = model.model.rotary_emb(embedded, position_ids)
    times, held, largest, working = [], 0, 0, 0
    for step in range(steps + 1):
        saved: dict[int, int] = {}

        def pack(tensor, saved=saved):  # this step's dict
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        hidden = embedded.clone().requires_grad_(True)
        dist.barrier()
        before = _status_kib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        counting = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with offload.saving() if offload else counting:  # only the innermost hooks apply
            for layer in model.model.layers:
                hidden = layer(
                    hidden, position_embeddings=rotary, position_ids=position_ids, use_cache=False
                )
        if mode.startswith("full_tiled"):  # a tiled layer keeps its kwargs on its autograd node
            saved.update(
                {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in rotary}
            )
        hidden.sum().backward()
        elapsed = time.perf_counter() - start
        if step:  # step 0 compiles
            times.append(elapsed)
            held, largest = sum(saved.values()), max(saved.values(), default=0)
            working = _status_kib("VmHWM") - before
    backend.require_sdpa_found()
    result = {
        "mode": mode,
        "held": held,
        "largest": largest,
        "working": working,
        "step_s": statistics.median(times),
    }
    if offload is not None:
        stats = offload.stats
        result.update(
            moved_per_layer=stats.to_host_bytes / (steps + 1) / LAYERS,
            resident=stats.peak_resident_bytes,
            held=stats.kept_bytes // (steps + 1) + stats.peak_resident_bytes,
        )
    return result


def _spec(mode: str):
    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing

    if mode.startswith("full"):
        return ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True)
    return ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0)


def plan_prediction(mode: str, seq: int, tile: int) -> dict:
    import torch

    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing
    from slurm_autosp.memory_plan.layer_graph import tiled_layer_trace, trace_decoder_layer

    local = seq // SP
    tiled = "tiled" in mode.split("_")  # not "untiled"
    whole_layers = mode.startswith("full_tiled")
    spec = _spec(mode)
    traced = ActivationCheckpointSpec(ActivationCheckpointing.none) if whole_layers else spec
    (trace,) = trace_decoder_layer(
        model_config(),
        local_seq=local,
        sp_size=SP,
        dtype=torch.float32,
        specs=[traced],
        tiled=tiled and not whole_layers,
    )
    if whole_layers:
        (untiled,) = trace_decoder_layer(
            model_config(), local_seq=local, sp_size=SP, dtype=torch.float32, specs=[spec]
        )
        trace = tiled_layer_trace(model_config(), spec, trace, untiled, torch.float32)
    layers = 2 if mode.endswith("offloaded") else LAYERS
    return {
        "held": layers * trace.activation_bytes + trace.shared_bytes,
        "largest": max(t.nbytes for t in trace.saved if t.kind != "parameter"),
        "working": trace.working_bytes_with(tile if tiled else 0),
    }


def rank_main(rank: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # six modes' backends compile the same layer code
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SP)
    rows = [run_mode(mode, args.seq, args.tile, args.steps) for mode in args.modes]
    if rank == 0:
        for row in rows:
            row["plan"] = plan_prediction(row["mode"], args.seq, args.tile)
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def _largest(row: dict, plan: dict) -> str:
    """The largest saved tensor beside the plan's; offloaded: the offload's hooks replace the
    counting ones, so no figure."""
    if row["mode"].endswith("offloaded"):
        return "-"
    return f"{_mib(row['largest'])} ({_mib(plan['largest'])}, {row['largest'] / plan['largest'] - 1:+.1%})"


def render(rows: list[dict], args: argparse.Namespace) -> str:
    bases = {row["mode"].startswith("full"): row for row in reversed(rows)}
    lines = [
        f"S = {args.seq} over SP={SP} ({args.seq // SP} tokens per rank), tiles of {args.tile} tokens, "
        f"hidden 64, intermediate 1024, {LAYERS} layers, fp32, sac budget 0 (full: full, all-to-alls "
        f"recomputed); rank 0, median of {args.steps} steps; step ratio against the first mode of its policy",
        "| mode | held for bw (plan) | largest saved (plan) | peak working (plan) | step | vs untiled | moved/layer | resident |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        plan = row["plan"]
        lines.append(
            f"| {row['mode']} | {_mib(row['held'])} ({_mib(plan['held'])}, {row['held'] / plan['held'] - 1:+.1%}) "
            f"| {_largest(row, plan)} "
            f"| {_mib(row['working'])} ({_mib(plan['working'])}, {row['working'] / plan['working'] - 1:+.1%}) "
            f"| {row['step_s'] * 1e3:.0f} ms "
            f"| x{row['step_s'] / bases[row['mode'].startswith('full')]['step_s']:.2f} "
            f"| {_mib(row['moved_per_layer']) if 'moved_per_layer' in row else '-'} "
            f"| {_mib(row['resident']) if 'resident' in row else '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--modes",
        type=lambda text: text.split(","),
        default=MODES,
        help=f"comma-separated, of {','.join(MODES)} (default: all)",
    )
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    from slurm_autosp.cluster.compile_cache import use_private_compile_cache

    # the user's own TORCHINDUCTOR_CACHE_DIR, else a fresh private one
    use_private_compile_cache(tempfile.mkdtemp(prefix="context_bench_cache_"))
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(os.path.join(tmp, "init"), args, out), nprocs=SP)
        print(render(json.loads(Path(out).read_text()), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
