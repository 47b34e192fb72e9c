"""Ulysses x ring on 4 CPU ranks: what each split of SP=4 costs per step, sends per layer and
keeps for backward, and what a sliding window saves the ring.

    python bench/ring_bench.py                    # S = 16384 over 4 CPU ranks
    python bench/ring_bench.py --seq 4096 --steps 2
    python bench/ring_bench.py --balance-only     # the load-balance table alone, no ranks

A tiny Llama (hidden 64, 4 query heads, 2 KV heads, 2 layers, fp32), its decoder layers
compiled per layer by our backend with SAC at budget 0 (the production policy for long
sequences), one sequence of S tokens over 4 CPU ranks (gloo) as Ulysses x ring = 4 x 1, 2 x 2
and 1 x 4, and the same model as Mistral with a window of S/16 tokens (shorter than a zigzag
chunk, S/8) as 1 x 4, against the unwindowed 1 x 4 (the ratio rows). Columns, per rank (the
largest over the ranks):
- step: median wall time of forward+backward (the machine has 2 cores for 4 ranks: compare
  the rows with each other, not with a GPU);
- sent/layer: bytes this rank sent per layer per step, counted in the ops
  (sp.communication_counts): the Ulysses all-to-alls' (what leaves the rank: (U-1)/U of each
  tensor) and ring attention's point-to-point sends (K/V blocks, and dK/dV in backward);
- saved B/tok/layer: bytes of distinct storages saved for backward per local token and layer
  (bench/saved_bytes.py);
- loss: the step's loss, the same for every split of one model (each is exact).

The second table is the ring's plan (sp/ring_plan.py), not a run: the causal query-key pairs
inside documents each ring rank computes, for one 128k-token row and for rows packed with
documents of uneven length (log-normal, median 2k tokens, fixed seed): the largest rank's work
over the mean, under the zigzag split (2R chunks) and under the deal of 2R x 4 chunks by their
work that packed rows get (sp/ring_layout.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from common import bench_parser, markdown_table, spawn_ranks

WORLD = 4
LAYERS = 2
SPLITS = [(4, 1, False), (2, 2, False), (1, 4, False), (1, 4, True)]  # (ulysses, ring, windowed)


def run_split(ulysses: int, ring: int, windowed: bool, seq: int, steps: int, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from saved_bytes import DecoderSavedBytes

    from slurm_autosp.cluster.parallel_dims import contiguous_parallel_dims
    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.config import ActivationCheckpointing, ModelConfig
    from slurm_autosp.model import build_model
    from slurm_autosp.run_step import run_module_step
    from slurm_autosp.sp import (
        communication_counts,
        prepare_sp_inputs,
        set_sp_groups,
    )

    torch._dynamo.reset()
    torch.manual_seed(0)
    window = {"model_type": "mistral", "extra": {"use_cache": False, "sliding_window": seq // 16}}
    plain = {"extra": {"use_cache": False}}
    model = build_model(ModelConfig(num_hidden_layers=LAYERS, **(window if windowed else plain)))
    spec = ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0)
    compile_model(model, AutoSPBackend(WORLD, spec, ring), per_layer=True, dynamic=False)
    dims = contiguous_parallel_dims(WORLD, ring, torch.device("cpu"))
    set_sp_groups(dims.ulysses_group, dims.ring_group)
    input_ids = torch.randint(1, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    shard = prepare_sp_inputs(input_ids, sp_rank=rank, sp_size=WORLD, ring_size=ring)
    saved_bytes = DecoderSavedBytes(model)
    times, sent = [], 0
    for step in range(steps + 1):  # the first compiles
        model.zero_grad(set_to_none=True)
        saved_bytes.clear()
        communication_counts.reset()
        dist.barrier()
        start = time.perf_counter()
        loss = run_module_step(model, [shard], WORLD, saving=saved_bytes.counting)
        loss = loss.micro_batches[0].loss
        if step:
            times.append(time.perf_counter() - start)
            sent = communication_counts.all_to_all_bytes + communication_counts.ring_bytes
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {
        "split": f"{ulysses} x {ring}" + (f", window {seq // 16}" if windowed else ""),
        "step_s": statistics.median(times),
        "sent_per_layer": sent / LAYERS,
        "saved_per_token_layer": saved_bytes.bytes / LAYERS / shard.input_ids.shape[1],
        "loss": float(total),
    }


def rank_main(rank: int, init_file: str, seq: int, steps: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    rows = []
    for ulysses, ring, windowed in SPLITS:
        rows.append(run_split(ulysses, ring, windowed, seq, steps, rank))
        print(f"[rank {rank}] seq {seq}: {json.dumps(rows[-1])}", flush=True)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def render(seq: int, ranks: list[list[dict]]) -> str:
    header = (
        f"S={seq}, SP=4 (Ulysses x ring)",
        "step (s)",
        "sent/layer (MiB)",
        "saved B/tok/layer",
        "loss",
    )
    table = []
    for rows in zip(*ranks, strict=True):
        worst = {k: max(r[k] for r in rows) for k in ("step_s", "sent_per_layer")}
        saved = max(r["saved_per_token_layer"] for r in rows)
        table.append(
            (
                rows[0]["split"],
                f"{worst['step_s']:.2f}",
                f"{worst['sent_per_layer'] / 2**20:.2f}",
                f"{saved:,.0f}",
                f"{rows[0]['loss']:.6f}",
            )
        )
    ring, windowed = table[2], table[3]
    table.append(
        (
            "window / no window (1 x 4)",
            f"{float(windowed[1]) / float(ring[1]):.2f}",
            f"{float(windowed[2]) / float(ring[2]):.2f}",
            "",
            "",
        )
    )
    return markdown_table(header, table, right=(1, 2, 3, 4))


BALANCE_SEQ = 131072
BALANCE_RINGS = (2, 4, 8)


def ring_work(document_lengths: list[int], ring: int, packed: bool) -> list[int]:
    """Causal query-key pairs inside documents that each ring rank computes, by the ring's plan:
    under the zigzag split (`packed` False) or the deal packed rows get."""
    from slurm_autosp.sp.ring_plan import ring_plan

    ends = [sum(document_lengths[: i + 1]) for i in range(len(document_lengths))]
    documents = tuple((0, end - n, end) for n, end in zip(document_lengths, ends, strict=True))
    plan = ring_plan(ring, ends[-1] // ring, documents, 0, packed)
    return [plan.pairs(rank) for rank in range(ring)]


def packed_documents(seq: int, seed: int = 0) -> list[int]:
    """One row of `seq` tokens cut into documents of log-normal lengths (median 2048)."""
    import numpy as np

    rng, lengths = np.random.default_rng(seed), []
    while sum(lengths) < seq:
        lengths.append(max(1, int(rng.lognormal(np.log(2048), 1.0))))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def render_balance() -> str:
    rows = []
    for name, lengths in (
        ("one document", [BALANCE_SEQ]),
        ("packed, seed 0", packed_documents(BALANCE_SEQ, 0)),
        ("packed, seed 1", packed_documents(BALANCE_SEQ, 1)),
    ):
        cells = []
        for packed in (False, True):
            for ring in BALANCE_RINGS:
                work = ring_work(lengths, ring, packed)
                cells.append(f"{max(work) / (sum(work) / ring) - 1:+.1%}")
        rows.append((f"{name} ({len(lengths)} document{'s' if len(lengths) > 1 else ''})", *cells))
    header = (
        f"S={BALANCE_SEQ}: largest rank's work over the mean",
        *(f"zigzag, ring {r}" for r in BALANCE_RINGS),
        *(f"dealt, ring {r}" for r in BALANCE_RINGS),
    )
    return markdown_table(header, rows, right=range(1, 1 + 2 * len(BALANCE_RINGS)))


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--balance-only", action="store_true", help="the load-balance table alone")
    args = parser.parse_args()
    if not args.balance_only:
        ranks = spawn_ranks(rank_main, (args.seq, args.steps), WORLD)
        print(render(args.seq, ranks), end="\n\n")
    print(render_balance())
    return 0


if __name__ == "__main__":
    sys.exit(main())
