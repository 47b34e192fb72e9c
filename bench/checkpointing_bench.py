"""Activation checkpointing policies side by side, per rank, on our AutoSP graphs (SP=2):
ours (`none`, `torch_default`, `full`, `sac`, `sac` replaying the all-to-alls) and DeepSpeed's
long-context policy (its `register_long_context_checkpointing`, which splices its own
`should_ban_recomputation` into torch's min-cut; applied to the same graphs here, and undone
after), plus the memory plan's prediction against measured memory.

    python bench/checkpointing_bench.py                         # seq 1024, 4096, 8192
    python bench/checkpointing_bench.py --seqs 2048 --steps 3

Same tiny Llama for every policy (hidden 64, intermediate 128, 4 heads, 2 KV heads, 4 layers,
vocab 256, fp32, sdpa), compiled per decoder layer by our backend with static shapes, one
sequence of S tokens over 2 CPU ranks (gloo), a fresh compile per (policy, S) with inductor's
caches off (DeepSpeed's splice is not in any cache key). Columns, per rank (the larger of the
two ranks where they differ):
- saved B/tok/layer: bytes of distinct storages saved for backward between the embedding and
  the final norm, i.e. by the compiled decoder layers (saved_tensors_hooks; hooks on the eager
  embedding and norm delimit them), parameters and the rotary cos/sin all layers share
  excluded, divided by layers and local tokens;
- O(S^2) saved: saved tensors with one dim >= S and another >= S/P;
- a2a in bw: all_to_all_single calls during backward (all layers);
- recompute: FLOPs the backward recomputes over the layer's forward+backward FLOPs (from the
  partitioned graphs of one layer at this shape: slurm_autosp.memory_plan.layer_graph);
- attn recomputed: SDPA forward kernels in the layer's backward graph;
- step: median wall time of forward+backward over the timed steps (the slower rank);
- loss / grad err: relative to `none` in the same run (loss; worst max|g - g_none| / max|g_none|).
`*_tiled`: the MLP in tiles of TILE tokens (compile.tile_tokens); `*_tiled_layers`: under `full`,
the whole layer in tiles (compile.tiled_layer); `*_offloaded`: every saved tensor to host memory
(compile.offload_activations), the saved column then counting what stays on the device (kept,
and the peak of copies fetched back) over the layers.
`deepspeed_attn_kept` is DeepSpeed's policy with the CPU SDPA kernel tagged must-save: its list
names only the CUDA kernels, so on CPU plain `deepspeed` recomputes attention; with the tag it
decides as it would on a GPU.
Plan vs measured (policies none and sac): predicted = the plan's activations held after the
forward (layers x the traced layer's saved bytes, shared cos/sin, final norm and loss inputs);
measured = VmRSS after the forward minus before it, with glibc's mmap threshold at 64 KiB so
freed tensors leave the resident set at once.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from common import REPO, bench_parser, markdown_table, spawn_ranks, write_json

SP = 2
LAYERS = 4
POLICIES = [
    "none",
    "torch_default",
    "full",
    "sac",
    "sac_replay_a2a",
    "deepspeed",
    "deepspeed_attn_kept",
    "sac_replay_a2a_tiled",
    "sac_replay_a2a_tiled_offloaded",
    "full_replay_a2a_tiled_layers",
    "full_replay_a2a_tiled_layers_offloaded",
]
CHUNK = 256
TILE = 256  # tokens per tile for the tiled rows


def tiny_llama_config():
    from slurm_autosp.config import ModelConfig

    return ModelConfig(num_hidden_layers=LAYERS)  # the config's default Llama


def _spec(policy: str):
    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing

    return {
        "none": ActivationCheckpointSpec(ActivationCheckpointing.none),
        "torch_default": ActivationCheckpointSpec(ActivationCheckpointing.torch_default),
        "full": ActivationCheckpointSpec(ActivationCheckpointing.full),
        "sac": ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0),
        "sac_replay_a2a": ActivationCheckpointSpec(
            ActivationCheckpointing.sac, budget=0.0, recompute_all_to_all=True
        ),
        "deepspeed": ActivationCheckpointSpec(
            ActivationCheckpointing.torch_default
        ),  # untagged: DeepSpeed's splice decides
        "deepspeed_attn_kept": ActivationCheckpointSpec(ActivationCheckpointing.torch_default),
        "sac_replay_a2a_tiled": ActivationCheckpointSpec(
            ActivationCheckpointing.sac, budget=0.0, recompute_all_to_all=True
        ),
        "full_replay_a2a_tiled_layers": ActivationCheckpointSpec(
            ActivationCheckpointing.full, recompute_all_to_all=True
        ),
    }[policy.removesuffix("_offloaded")]


def _tiled(policy: str) -> bool:
    return "_tiled" in policy


def _whole_layers(policy: str) -> bool:
    return "_tiled_layers" in policy


class _KeepAttentionOnly:
    """Tags only the SDPA kernels MUST_SAVE (DeepSpeed's splice honours the tag). DeepSpeed's own
    must-save list names the CUDA SDPA kernels, not the CPU one these graphs contain; with this
    tag its policy behaves on CPU as it does on a GPU."""

    def __new__(cls):
        from torch._inductor.custom_graph_pass import CustomGraphPass
        from torch.utils.checkpoint import CheckpointPolicy

        from slurm_autosp.compile.activation_checkpointing import ATTENTION_OPS

        class KeepAttention(CustomGraphPass):
            def __call__(self, graph):
                for node in graph.nodes:
                    if node.op == "call_function" and node.target in ATTENTION_OPS:
                        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                        for user in node.users:
                            user.meta["recompute"] = CheckpointPolicy.MUST_SAVE

            def uuid(self):
                return "bench-keep-attention"

        return KeepAttention()


def _scope(policy: str):
    import contextlib

    import torch

    if policy == "deepspeed":
        return deepspeed_policy()
    if policy == "deepspeed_attn_kept":
        stack = contextlib.ExitStack()
        stack.enter_context(deepspeed_policy())
        stack.enter_context(
            torch._inductor.config.patch(joint_custom_post_pass=_KeepAttentionOnly())
        )
        return stack
    return contextlib.nullcontext()


class deepspeed_policy:
    """DeepSpeed's long-context checkpointing for the duration of a block, then torch's own."""

    def __enter__(self):
        import torch._functorch.partitioners as partitioners
        from deepspeed.compile.passes.long_context_checkpointing import (
            register_long_context_checkpointing,
        )

        self.partitioners, self.original = partitioners, partitioners.solve_min_cut
        register_long_context_checkpointing()

    def __exit__(self, *exc):
        self.partitioners.solve_min_cut = self.original


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_policy(policy: str, seq: int, steps: int, rank: int):
    import contextlib

    import torch
    import torch.distributed as dist
    from saved_bytes import DecoderSavedBytes
    from transformers import LlamaConfig, LlamaForCausalLM

    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.compile.activation_checkpointing import is_quadratic
    from slurm_autosp.run_step import run_module_step
    from slurm_autosp.sp import prepare_sp_inputs
    from slurm_autosp.sp.offload import ActivationOffload

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = tiny_llama_config()
    model = LlamaForCausalLM(
        LlamaConfig(**m.hf_fields(), attn_implementation="sdpa", use_cache=False)
    )
    scope = _scope(policy)
    compile_model(
        model,
        AutoSPBackend(SP, _spec(policy)),
        per_layer=True,
        dynamic=False,
        tile_tokens=TILE if _tiled(policy) else 0,
    )
    offload = (
        ActivationOffload("cpu", layers=LAYERS, min_bytes=0)
        if policy.endswith("_offloaded")
        else None
    )
    input_ids = torch.randint(1, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    shard = prepare_sp_inputs(input_ids, sp_rank=rank, sp_size=SP)
    local = shard.input_ids.shape[1]

    saved_bytes = DecoderSavedBytes(model)
    saving = offload.saving if offload else saved_bytes.counting
    a2a = {"count": 0, "backward": False}
    original_a2a = dist.all_to_all_single

    def counting_a2a(*args, **kw):
        a2a["count"] += a2a["backward"]
        return original_a2a(*args, **kw)

    marks = {}

    @contextlib.contextmanager
    def phases(name):
        """The resident set around the forward; all-to-alls counted during backward."""
        if name == "forward":
            marks["before"] = _rss()
            yield
            marks["after"] = _rss()
        else:
            a2a["backward"] = True
            yield
            a2a["backward"] = False

    dist.all_to_all_single = counting_a2a
    times, rss = [], {}
    try:
        with scope:
            for step in range(steps + 1):
                model.zero_grad(set_to_none=True)
                saved_bytes.clear()
                a2a["count"] = 0
                dist.barrier()
                start = time.perf_counter()
                step_losses = run_module_step(
                    model, [shard], SP, chunk_tokens=CHUNK, saving=saving, phases=phases
                )
                loss = step_losses.micro_batches[0].loss
                if step:
                    times.append(time.perf_counter() - start)
                    rss = {"forward_delta": marks["after"] - marks["before"]}
    finally:
        dist.all_to_all_single = original_a2a
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad / dist.get_world_size()
    saved = saved_bytes.bytes
    if offload is not None:  # what stays on the device: kept, and the peak of fetched copies
        saved = offload.stats.kept_bytes // (steps + 1) + offload.stats.peak_resident_bytes
    return {
        "saved_per_token_layer": saved / LAYERS / local,
        "quadratic": None
        if offload
        else sum(is_quadratic(s, local, SP) for s in saved_bytes.shapes),
        "a2a_backward": a2a["count"],
        "step_s": statistics.median(times),
        "loss": total,
        "grads": grads,
        "rss_forward_delta": rss["forward_delta"],
        "local": local,
    }


def layer_trace(policy: str, seq: int):
    import torch

    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing
    from slurm_autosp.memory_plan.layer_graph import (
        forget_traces,
        tiled_layer_trace,
        trace_decoder_layer,
    )

    forget_traces()  # DeepSpeed's rows trace under its own min-cut
    spec, whole_layers = _spec(policy), _whole_layers(policy)
    traced = ActivationCheckpointSpec(ActivationCheckpointing.none) if whole_layers else spec
    with _scope(policy):
        (trace,) = trace_decoder_layer(
            tiny_llama_config(),
            local_seq=seq // SP,
            sp_size=SP,
            specs=[traced],
            dtype=torch.float32,
            tiled=_tiled(policy) and not whole_layers,
        )
        if whole_layers:
            (untiled,) = trace_decoder_layer(
                tiny_llama_config(),
                local_seq=seq // SP,
                sp_size=SP,
                specs=[spec],
                dtype=torch.float32,
            )
            trace = tiled_layer_trace(tiny_llama_config(), spec, trace, untiled, torch.float32)
    return trace


def predicted_forward_bytes(trace, local: int) -> float:
    """The plan's activations held after the forward, for this tiny fp32 model at batch 1."""
    h = tiny_llama_config().hidden_size
    final_norm_and_loss = h * 4 + 4 + h * 4 + 8 + 8  # norm input, rsqrt, lm_head input, labels, ids
    return LAYERS * trace.activation_bytes + trace.shared_bytes + final_norm_and_loss * local


def rank_main(rank: int, init_file: str, seqs: list[int], steps: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SP)
    from slurm_autosp.sp import set_sp_group

    set_sp_group(dist.group.WORLD)
    rows = []
    for seq in seqs:
        reference = None
        for policy in POLICIES:
            result = run_policy(policy, seq, steps, rank)
            if reference is None:
                reference = result
            grad_err = max(
                float((result["grads"][k] - g).abs().max() / g.abs().max())
                for k, g in reference["grads"].items()
            )
            loss_err = float((result["loss"] - reference["loss"]).abs() / reference["loss"].abs())
            row = {k: v for k, v in result.items() if k not in ("grads", "loss")}
            row.update(
                policy=policy,
                seq=seq,
                loss_err=loss_err,
                grad_err=grad_err,
                loss=float(result["loss"]),
            )
            if rank == 0:
                trace = layer_trace(policy, seq)
                row["recompute_share"] = trace.recompute_flops / max(
                    trace.forward_flops + trace.backward_flops, 1
                )
                row["attention_recomputed"] = trace.recomputed_attention
                row["plan_saved_per_token_layer"] = trace.activation_bytes / trace.tokens
                row["predicted_forward_bytes"] = predicted_forward_bytes(trace, result["local"])
            rows.append(row)
            print(
                f"[rank {rank}] seq {seq} {policy}: {json.dumps({k: row[k] for k in row if k != 'grads'}, default=str)}",
                flush=True,
            )
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def _quadratic(a: dict, b: dict) -> str:
    """O(S^2) saved tensors; offloaded rows: the offload's hooks replace the counting ones
    (their graphs are the tiled rows')."""
    return "-" if a["quadratic"] is None else str(max(a["quadratic"], b["quadratic"]))


def render(rows0: list[dict], rows1: list[dict]) -> str:
    saved = markdown_table(
        (
            "S (P=2)",
            "policy",
            "saved B/tok/layer",
            "O(S²) saved",
            "a2a in bw",
            "recompute",
            "attn recomputed",
            "step (s)",
            "loss err",
            "grad err",
        ),
        [
            (
                a["seq"],
                a["policy"],
                f"{max(a['saved_per_token_layer'], b['saved_per_token_layer']):,.0f}",
                _quadratic(a, b),
                max(a["a2a_backward"], b["a2a_backward"]),
                f"{a['recompute_share']:.1%}",
                a["attention_recomputed"],
                f"{max(a['step_s'], b['step_s']):.3f}",
                f"{max(a['loss_err'], b['loss_err']):.1e}",
                f"{max(a['grad_err'], b['grad_err']):.1e}",
            )
            for a, b in zip(rows0, rows1, strict=True)
        ],
    )
    planned = markdown_table(
        (
            "S (P=2)",
            "policy",
            "plan: held after forward",
            "measured (VmRSS delta, rank 0)",
            "error",
        ),
        [
            (
                a["seq"],
                a["policy"],
                f"{a['predicted_forward_bytes'] / 2**20:.2f} MiB",
                f"{a['rss_forward_delta'] / 2**20:.2f} MiB",
                f"{a['predicted_forward_bytes'] / a['rss_forward_delta'] - 1:+.1%}",
            )
            for a in rows0
            if a["policy"] in ("none", "sac", "sac_replay_a2a")
        ],
    )
    return f"{saved}\n\n{planned}"


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seqs", default="1024,4096,8192")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "checkpointing_results.json"))
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the resident set at once

    rows = spawn_ranks(rank_main, (seqs, args.steps), SP)
    write_json(args.out, rows)
    print(render(rows[0], rows[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
