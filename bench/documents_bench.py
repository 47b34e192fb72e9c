"""Packed documents against plain causal rows, per rank, on our AutoSP graphs (SP=2): what the
per-document attention op costs when a row holds one document, and what it saves when it
holds several.

    python bench/documents_bench.py                   # S = 8192 over 2 CPU ranks
    python bench/documents_bench.py --seq 4096 --steps 3

A tiny Llama (hidden 64, intermediate 128, 4 heads, 2 KV heads, 4 layers, vocab 256, fp32),
its decoder layers compiled per layer by our backend with static shapes and SAC at budget 0
(attention outputs kept, as for long sequences), one row of S tokens over 2 CPU ranks (gloo,
one thread each). One model and one set of weights serves every mode:
- sdpa: one document, as `prepare_sp_inputs` passes it (no boundaries: the SDPA kernel);
- op, 1 document: the same row with its one boundary pair (cu_seqlens = [0, S]) handed to the
  model, so `document_attention` runs over the whole row: the cost of the op itself;
- op, N documents: the row as N documents of S/N tokens (`document_ids`), so each document
  attends only to itself and the blocks across documents are never computed.
The modes take turns step by step, so machine noise falls on all of them alike. Columns:
- step: median wall time of forward+backward over the timed steps (the slower rank); best:
  the fastest step (the least disturbed on a shared machine);
- / sdpa: the median over steps of this mode's step over sdpa's step just before it (paired, so
  a load that comes and goes on the machine falls on both sides of each ratio);
- saved B/tok/layer: bytes of distinct storages saved for backward by the compiled decoder
  layers (saved_tensors_hooks between the embedding and the final norm; parameters and the
  rotary cos/sin all layers share excluded), over layers and local tokens (the larger rank);
- loss err: relative to sdpa (same tokens and weights; the N-document loss differs by design,
  so it is not compared).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from common import REPO, bench_parser, markdown_table, spawn_ranks, write_json

SP = 2
LAYERS = 4
CHUNK = 256


def run_modes(seq: int, documents: int, steps: int, rank: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from saved_bytes import DecoderSavedBytes

    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing, ModelConfig
    from slurm_autosp.model import build_model
    from slurm_autosp.run_step import run_module_step
    from slurm_autosp.sp import prepare_sp_inputs

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=LAYERS, extra={"use_cache": False}))
    spec = ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0)
    compile_model(model, AutoSPBackend(SP, spec), per_layer=True, dynamic=False)
    input_ids = torch.randint(1, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    plain = prepare_sp_inputs(input_ids, sp_rank=rank, sp_size=SP)
    padded = seq + (-seq % SP)
    one_document = dataclasses.replace(
        plain,
        cu_seqlens=torch.tensor([0, padded], dtype=torch.int32),
        longest_document=padded,
    )
    document_ids = (torch.arange(seq) * documents // seq).unsqueeze(0)
    packed = prepare_sp_inputs(input_ids, sp_rank=rank, sp_size=SP, document_ids=document_ids)
    assert packed.cu_seqlens is not None and len(packed.cu_seqlens) == documents + 1
    modes = {"sdpa": plain, "op, 1 document": one_document, f"op, {documents} documents": packed}
    local = plain.input_ids.shape[1]

    saved = DecoderSavedBytes(model)
    results = {name: {"times": [], "saved": 0, "loss": None, "grads": None} for name in modes}
    for step in range(steps + 1):  # step 0 compiles and warms up
        for name in modes:
            model.zero_grad(set_to_none=True)
            saved.clear()
            dist.barrier()
            start = time.perf_counter()
            step_losses = run_module_step(
                model, [modes[name]], SP, chunk_tokens=CHUNK, saving=saved.counting
            )
            loss = step_losses.micro_batches[0].loss
            elapsed = time.perf_counter() - start
            result = results[name]
            if step:
                result["times"].append(elapsed)
            result["saved"] = saved.bytes
            total = loss.detach().clone()
            dist.all_reduce(total)
            result["loss"] = float(total)
            result["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            print(f"[rank {rank}] step {step} {name}: {elapsed:.3f} s", flush=True)
    reference = results["sdpa"]
    rows = []
    for name, result in results.items():
        grad_err = max(
            float((result["grads"][n] - g).abs().max() / g.abs().max())
            for n, g in reference["grads"].items()
        )
        rows.append(
            {
                "mode": name,
                "seq": seq,
                "times": result["times"],
                "saved_per_token_layer": result["saved"] / LAYERS / local,
                "loss": result["loss"],
                "loss_err": abs(result["loss"] - reference["loss"]) / abs(reference["loss"]),
                "grad_err": grad_err,
            }
        )
    return rows


def rank_main(rank: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SP)
    from slurm_autosp.sp import set_sp_group

    set_sp_group(dist.group.WORLD)
    rows = run_modes(args.seq, args.documents, args.steps, rank)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def render(rows0: list[dict], rows1: list[dict]) -> str:
    steps = [
        [max(t) for t in zip(a["times"], b["times"], strict=True)]
        for a, b in zip(rows0, rows1, strict=True)
    ]
    header = ("S (P=2)", "attention", "step (s)", "best (s)", "/ sdpa", "saved B/tok/layer")
    table = []
    for a, b, times in zip(rows0, rows1, steps, strict=True):
        ratio = statistics.median(t / s for t, s in zip(times, steps[0], strict=True))
        compared = a["mode"] in ("sdpa", "op, 1 document")
        errors = (
            (f"{max(a['loss_err'], b['loss_err']):.1e}", f"{max(a['grad_err'], b['grad_err']):.1e}")
            if compared
            else ("–", "–")
        )
        table.append(
            (
                a["seq"],
                a["mode"],
                f"{statistics.median(times):.3f}",
                f"{min(times):.3f}",
                f"{ratio:.2f}×",
                f"{max(a['saved_per_token_layer'], b['saved_per_token_layer']):,.0f}",
                *errors,
            )
        )
    return markdown_table((*header, "loss err", "grad err"), table, right=range(2, 8))


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--documents", type=int, default=8, help="documents of the packed row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    parser.add_argument("--out", default=str(REPO / "bench" / "documents_results.json"))
    args = parser.parse_args()

    rows = spawn_ranks(rank_main, (args,), SP)
    write_json(args.out, rows)
    print(render(rows[0], rows[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
