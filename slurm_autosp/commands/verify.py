"""Check, before spending GPU hours, that AutoSP trains your model exactly as one device would.

    python -m slurm_autosp verify cfg=configs/llama8b_32k.yaml parallel.sp_size=4
    python -m slurm_autosp verify cfg=configs/tiny_cpu.yaml parallel.sp_size=2 compile.enabled=true --dp 2

The configured model is shrunk to a CPU-sized copy with the same head layout (the same
num_attention_heads and num_key_value_heads, hence the same grouped-query ratio and the same
way heads split over the SP ranks), the same model class, RoPE settings and compile mode
(compile.per_layer), but 2 layers, head_dim 8 (an MLA model's rotary and latent parts too),
a 256-token vocabulary and no dropout or router jitter (each rank draws its own). It first
runs on one device without AutoSP: a model that fails on its own is named there (exit 2). Then
parallel.sp_size x dp local CPU ranks (gloo) run one AutoSP training step in fp32 (Ulysses x
ring when parallel.ring_size > 1: the ranks' Ulysses and ring groups as a job builds them), on a batch
whose sequence length is not divisible by the SP size and whose ignored labels are spread
unevenly over the shards, and one device runs the plain model on the same batch. Gradients
are averaged over all ranks, as DeepSpeed ZeRO-1 does, with slurm_autosp.sp.loss_scale.
An MoE trained with its router's load-balancing loss (output_router_logits) is compared with
the plain model's loss plus coef x its family's aux over each DP replica's rows as one
micro-batch, averaged over the replicas (what training optimises).

Printed: the loss of both, the largest per-token loss difference, and for every parameter
max|g - g_ref| / max|g_ref| (the worst few named; max|g_ref| taken as at least 1e-5 of the
model's largest gradient, as a gradient zero in exact arithmetic is rounding alone). Exit status 0 when every figure is at most
the tolerance (1e-5), 1 when one is not or a rank fails, 2 for a refused configuration
(docs/refusals.md).

Arguments:
  cfg=PATH.yaml           the job config, with any key=value overrides, as for submit
                          (e.g. parallel.sp_size=2 to check fewer ranks than the config asks;
                          parallel.sp_size=4 parallel.ring_size=2 to check Ulysses 2 x ring 2)
  --dp N                  also run N data-parallel replicas (world = sp_size x N); verify.dp=N
  verify.layers=2         decoder layers of the shrunk copy
  verify.head_dim=8       head dimension of the shrunk copy (hidden = heads x head_dim)
  verify.vocab_size=256   vocabulary of the shrunk copy
  verify.seq_len=0        tokens per sequence; 0 picks 32 x sp_size - 3 (not divisible by SP)
  verify.rows=2           sequences per data-parallel rank
  verify.documents=0      documents packed per row (document_ids), N >= 2 of uneven lengths: one
                          spans a shard boundary, one is shorter than a shard, one shard holds
                          only a document's tail; the reference trains each document alone
  verify.window=0         where the model windows attention, the shrunk copy's window in tokens
                          (shorter than verify.seq_len, so the window matters); 0: the model's
  verify.tolerance=1e-5   the largest relative error that passes
  verify.seed=0           weights and batch
  verify.codegen=true     false: the SP step's graphs run without inductor's code generation
                          (AOTAutograd as traced): the SP rewrite checked in seconds, not
                          inductor's kernels nor the checkpointing pass
  verify.inject=none      testing hook: per_shard_shift shifts labels inside each shard, the
                          shard-boundary bug of other SP implementations; verify must then fail
"""

from __future__ import annotations

import sys
import time

from slurm_autosp.cluster.compile_cache import use_private_compile_cache
from slurm_autosp.commands.arguments import arguments, config_error
from slurm_autosp.config import ConfigError, load_config, with_default_config
from slurm_autosp.verify.check import admit_verify, run_verify
from slurm_autosp.verify.options import (
    load_options,
    split_arguments,
    verify_seq_len,
)
from slurm_autosp.verify.report import failures, format_report


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    try:
        job_args, verify_args = split_arguments(argv)
        options = load_options(verify_args)
        cfg = load_config(with_default_config(job_args))
        admit_verify(cfg, options)
        use_private_compile_cache(cfg.compile.cache_dir)  # the ranks inherit it
    except ConfigError as err:
        return config_error(err)
    if cfg.parallel.sp_size == 1:
        print(
            "note: parallel.sp_size=1, so nothing is split; pass parallel.sp_size=N to check N-way SP",
            flush=True,
        )
    seq_len = verify_seq_len(cfg.parallel.sp_size, options)
    if cfg.parallel.sp_size > 1 and seq_len % cfg.parallel.sp_size == 0:
        print(
            f"note: verify.seq_len={seq_len} divides by sp_size; the padding path is not exercised",
            flush=True,
        )
    start = time.perf_counter()
    try:
        report = run_verify(cfg, options)
    except Exception as err:  # a rank failed (torch.multiprocessing carries its traceback)
        print(
            f"{err}\nerror: a verify rank failed: {str(err).strip().splitlines()[-1]}",
            file=sys.stderr,
        )
        return 1  # a crash, not a refusal
    print(format_report(report, options.tolerance))
    print(f"({cfg.parallel.sp_size * options.dp} ranks, {time.perf_counter() - start:.1f} s)")
    return 1 if failures(report, options.tolerance) else 0
