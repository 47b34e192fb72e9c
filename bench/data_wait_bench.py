"""Data wait per step at S = 131072: what the training loop's "data" phase does on the host
(shuffled samples read from a memory-mapped token file, labels from a chat loss mask, the SP
shard cut), timed, against a step time, as a share of the step (goal < 1%).

    python bench/data_wait_bench.py                      # SP=8, micro_batch 1
    python bench/data_wait_bench.py --step-seconds 6.3

The step time is not measured here (no GPU): by default it is Llama-3.1-8B's training FLOPs
for one 131,072-token sequence (6 N S for the weights, 6 L S^2 d for causal attention) on an
SP group of 8 H200 at 40% MFU of 989 TFLOP/s each; pass a measured one with --step-seconds.
The host copy to the GPU and the label-count all-reduce are not in the figure.
"""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import bench_parser

from slurm_autosp.config import JobConfig
from slurm_autosp.data import ShuffledSource, TokenFileSource, micro_batch, write_token_file
from slurm_autosp.sp import prepare_sp_inputs

SEQ = 131_072
PARAMS, LAYERS, HIDDEN = 8.03e9, 32, 4096  # Llama-3.1-8B


def modelled_step_seconds(gpus: int, mfu: float, peak_tflops: float) -> float:
    flops = 6 * PARAMS * SEQ + 6 * LAYERS * SEQ**2 * HIDDEN
    return flops / (gpus * mfu * peak_tflops * 1e12)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--sp", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64, help="samples in the token file")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-seconds", type=float, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.tokens"
        rng = np.random.default_rng(0)
        write_token_file(path, rng.integers(0, 128_256, args.samples * SEQ), vocab_size=128_256)
        mask = Path(tmp) / "train.loss_mask.npy"
        np.save(mask, (rng.random(args.samples * SEQ) < 0.5).astype(np.uint8))
        source = ShuffledSource(TokenFileSource(path, SEQ, 128_256, mask), seed=0)
        cfg = JobConfig()
        cfg.data.seq_len, cfg.parallel.sp_size, cfg.cluster.tasks_per_node = SEQ, args.sp, args.sp
        times = []
        for step in range(args.steps):
            start = time.perf_counter()
            batch = micro_batch(source, cfg, step, 0, 0)
            prepare_sp_inputs(batch.input_ids, batch.labels, sp_rank=args.sp - 1, sp_size=args.sp)
            times.append(time.perf_counter() - start)
    step_s = args.step_seconds or modelled_step_seconds(args.sp, 0.4, 989.0)
    wait = statistics.median(times)
    print(
        f"S={SEQ}, SP={args.sp}: data {wait * 1e3:.2f} ms/step (median of {args.steps}, max "
        f"{max(times) * 1e3:.2f} ms); step {step_s:.2f} s; share {100 * wait / step_s:.3f}%"
    )


if __name__ == "__main__":
    main()
