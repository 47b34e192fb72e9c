"""What stopping at layer boundaries costs a step (cluster.stop_at=layer): the agreement each
boundary carries, against the same step without it, measured in one run.

    python bench/layer_stop_bench.py                        # 16 layers, 2,048 tokens a rank
    python bench/layer_stop_bench.py --layers 32 --seq 4096 --steps 7

Two CPU ranks (gloo) each run forward and backward of a tiny Llama (hidden 64) over their own
sequence, as DP ranks do, `--steps` times with its layers' boundaries armed (LayerStops, on a
gloo group of its own) and as many times without, alternating; times are the slower rank's
medians. Rows:
- step: forward + backward without boundaries, and with them (2 a layer: its call and the
  gradient of its output);
- per boundary: the step's difference over its boundaries: what a layer pays;
- agreement alone: boundaries passed back to back with nothing between them, each waiting
  for the all-reduce the previous one started (the most a boundary can wait);
- all-reduce: one synchronous gloo all-reduce of the same 4-byte flag (the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from common import bench_parser, markdown_table, spawn_ranks

WORLD = 2


def rank_main(rank: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from slurm_autosp.compile import decoder_layers
    from slurm_autosp.config import ModelConfig
    from slurm_autosp.lifecycle.layer_stops import LayerStops
    from slurm_autosp.lifecycle.signals import StopRequest
    from slurm_autosp.model import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(num_hidden_layers=args.layers, max_position_embeddings=args.seq)
    )
    stops = LayerStops.install(decoder_layers(model), StopRequest())
    tokens = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(rank))

    def step(armed: bool) -> float:
        dist.barrier()
        started = time.perf_counter()
        if armed:
            with stops.armed():
                model(input_ids=tokens, labels=tokens).loss.backward()
        else:
            model(input_ids=tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    step(False), step(True)  # warm-up
    plain, armed = [], []
    for _ in range(args.steps):
        plain.append(step(False))
        armed.append(step(True))
    passed = stops.boundaries
    step(True)
    per_step = stops.boundaries - passed

    dist.barrier()
    started = time.perf_counter()
    with stops.armed():
        for _ in range(args.calls):
            stops.boundary()
    alone = (time.perf_counter() - started) / args.calls

    flag = torch.zeros(1, dtype=torch.int32)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.calls):
        dist.all_reduce(flag)
    all_reduce = (time.perf_counter() - started) / args.calls
    row = {
        "plain": statistics.median(plain),
        "armed": statistics.median(armed),
        "boundaries": per_step,
        "alone": alone,
        "all_reduce": all_reduce,
    }
    Path(f"{out}.{rank}").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048, help="tokens a rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="boundaries timed back to back")
    args = parser.parse_args()
    ranks = spawn_ranks(rank_main, (args,), WORLD)
    slowest = {key: max(r[key] for r in ranks) for key in ("plain", "armed", "alone", "all_reduce")}
    boundaries = ranks[0]["boundaries"]
    per_boundary = (slowest["armed"] - slowest["plain"]) / boundaries
    print(
        f"layer stops: {WORLD} CPU ranks, Llama hidden 64, {args.layers} layers, {args.seq} tokens "
        f"a rank; medians of {args.steps} steps each way, the slower rank"
    )
    rows = [
        ("step without boundaries", f"{slowest['plain'] * 1e3:,.1f} ms", 1),
        (
            f"step with {boundaries} boundaries",
            f"{slowest['armed'] * 1e3:,.1f} ms",
            f"{slowest['armed'] / slowest['plain']:.3f}",
        ),
        (
            f"per boundary (difference / {boundaries})",
            f"{per_boundary * 1e6:,.0f} us",
            f"{per_boundary / slowest['plain']:.2%}",
        ),
        ("agreement alone, back to back", f"{slowest['alone'] * 1e6:,.0f} us", "-"),
        ("one synchronous gloo all-reduce", f"{slowest['all_reduce'] * 1e6:,.0f} us", "-"),
    ]
    print(markdown_table(("what", "time", "against the step"), rows, right=(1, 2)))


if __name__ == "__main__":
    main()
