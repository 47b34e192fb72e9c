"""Host memory of the Hugging Face export on rank 0: the streamed export (shards of at most
--shard-mb) against the gathered state dict handed to save_pretrained, as the export did
before, for the same model arriving tensor by tensor (each a fresh bf16 tensor, as FSDP2
gathers it). Each mode runs in a process of its own, so its peak RSS is its own.

    python bench/export_bench.py                     # Llama, hidden 2048, 8 layers: 0.98 GB
    python bench/export_bench.py --layers 16 --shard-mb 512
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import bench_parser, markdown_table
from transformers import LlamaConfig, LlamaForCausalLM

from slurm_autosp.checkpoint.export import distinct_tensors, export_hf
from slurm_autosp.lifecycle.run_dir import RunDir


def measure(mode: str, layers: int, shard_mb: int, out: Path) -> dict:
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)

    def gathered():
        for name, tensor in distinct_tensors(model):
            yield name, torch.ones(tensor.shape, dtype=torch.bfloat16)

    sizes = [t.numel() * 2 for _, t in distinct_tensors(model)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if mode == "streamed":
        export_hf(model, out, gathered(), max_shard_bytes=shard_mb * 10**6)
    else:
        hf = RunDir(out).hf_export
        model.save_pretrained(hf, state_dict=dict(gathered()), max_shard_size=f"{shard_mb}MB")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    files = len(list(RunDir(out).hf_export.glob("*.safetensors")))
    return {"model": sum(sizes), "largest": max(sizes), "peak": peak, "s": seconds, "files": files}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--mode", choices=["streamed", "gathered"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(args.mode, args.layers, args.shard_mb, Path(tmp))))
        return
    rows = {}
    for mode in ("gathered", "streamed"):
        command = [sys.executable, __file__, "--mode", mode, f"--layers={args.layers}"]
        done = subprocess.run(
            [*command, f"--shard-mb={args.shard_mb}"], capture_output=True, text=True, check=True
        )
        rows[mode] = json.loads(done.stdout.splitlines()[-1])
    first = rows["streamed"]
    print(
        f"model {first['model'] / 1e9:.2f} GB (bf16), largest tensor {first['largest'] / 1e6:.0f} "
        f"MB, shards of at most {args.shard_mb} MB"
    )
    bound = {"gathered": "the model", "streamed": "a shard + the largest tensor"}
    print(
        markdown_table(
            ("export", "peak RSS above start", "bound", "files", "seconds"),
            [
                (mode, f"{row['peak'] / 1e9:.2f} GB", bound[mode], row["files"], f"{row['s']:.1f}")
                for mode, row in rows.items()
            ],
            right=(1, 2, 3, 4),
        )
    )


if __name__ == "__main__":
    main()
