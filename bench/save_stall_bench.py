"""The training stall of a checkpoint save, synchronous against asynchronous, and the save's
throughput against the disk's own `dd` rate, measured in one run.

    python bench/save_stall_bench.py                  # Llama hidden 512, 4 layers: ~0.7 GB checkpoint
    python bench/save_stall_bench.py --layers 8 --saves 3 --engine fsdp2
    python bench/save_stall_bench.py --hidden 1536 --saves 5     # 9x the bytes per tensor

Two CPU ranks (gloo, fp32, DP=2) build the engine the job would (`build_engine`, ZeRO-1 or
FSDP2), take one optimizer step so Adam's state exists, then save `--saves` times each way
through the job's own path (`CheckpointSaves`) into a run directory beside the disk's `dd` file:
- sync stall: `save(..., synchronous=True)`, everything on storage, fsynced and hashed;
- async stall: `save(..., synchronous=False)`: the state copied into the staging buffers in
  /dev/shm (FSDP2's distributed checkpoint written there) and handed to the writer processes;
  training would go on from here;
- async written: from the stall's end until every rank's writer is done (the background part),
  then the commit (manifest, rename, `latest`) at the next step boundary.
- one memory copy: the bytes a rank staged, copied once between two buffers already mapped,
  and the rank's state copied tensor by tensor (each storage once) into one: the floors of
  the stall, the second with the state's own layout, each measured after every asynchronous
  save (the machine's memory bandwidth drifts between runs more than the stall's overhead).
Times are the slower rank's, medians over the saves (the first asynchronous save maps its
buffer: `--saves` of at least 3 keep the median off it); the stall's ratio to a floor is the
median of each save's ratio to the floor measured after it. dd writes the checkpoint's size with
fsync (`conv=fsync`) to the same directory: the disk's sequential write rate in this run.
About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import bench_parser

WORLD = 2


def rank_main(rank: int, init_file: str, args: argparse.Namespace, root: str, out: str) -> None:
    import json

    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    import deepspeed
    import torch
    import torch.distributed as dist

    from slurm_autosp.checkpoint.async_save import CheckpointSaves
    from slurm_autosp.checkpoint.store import CheckpointStore, TrainerState
    from slurm_autosp.config import load_config
    from slurm_autosp.engine import build_engine
    from slurm_autosp.lifecycle.lock import RunLock

    deepspeed.utils.logger.setLevel("WARNING")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    stage = 1 if args.engine == "zero1" else 3
    cfg = load_config(
        [
            f"run.output_root={root}",
            f"cluster.tasks_per_node={WORLD}",
            "parallel.sp_size=1",
            f"parallel.zero_stage={stage}",
            "compile.enabled=false",
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={args.hidden * 11 // 4}",
            f"model.num_hidden_layers={args.layers}",
            "model.num_attention_heads=8",
            "model.num_key_value_heads=8",
            "model.vocab_size=32000",
        ]
    )
    torch.manual_seed(0)
    engine = build_engine(cfg, torch.device("cpu"), stage)
    ids = torch.randint(0, 32000, (1, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    store = CheckpointStore(Path(root) / "checkpoints", rank, WORLD, keep=2)
    # staging belongs to a job: the bench's own process, on this host, is this one
    bench = RunLock(str(os.getppid()), "local", socket.gethostname())
    saves = CheckpointSaves.start(store, True, "/dev/shm", Path(root), job=bench)

    def state(step: int) -> TrainerState:
        return TrainerState(step, step, WORLD, "bench", engine.name)

    def slowest(seconds: float) -> float:
        box = torch.tensor([seconds])
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box)

    rows: dict[str, list[float]] = {
        "sync": [],
        "async": [],
        "written": [],
        "commit": [],
        "memcpy": [],
        "tensors": [],
    }
    step = 0
    for _ in range(args.saves):
        step += 1
        dist.barrier()
        start = time.perf_counter()
        saves.save(engine, state(step), synchronous=True)
        rows["sync"].append(slowest(time.perf_counter() - start))
    source = target = storages = None
    for _ in range(args.saves):
        step += 1
        dist.barrier()
        start = time.perf_counter()
        saves.save(engine, state(step), synchronous=False)
        stalled = time.perf_counter()
        rows["async"].append(slowest(stalled - start))
        while saves.writing():
            time.sleep(0.005)
        rows["written"].append(slowest(time.perf_counter() - stalled))
        start = time.perf_counter()
        saves.commit_written(False)
        rows["commit"].append(slowest(time.perf_counter() - start))
        if source is None:  # the floors' buffers, their pages mapped before they are timed
            source = torch.ones(saves.staged_bytes, dtype=torch.uint8)
            target = torch.empty_like(source)
            target.copy_(source)
            storages = state_storages(store.state_files(engine, state(step)))
        # the floors of the stall, measured right after it on the same machine state: the
        # same number of bytes copied at once, and the state's own tensors, each copied once
        dist.barrier()
        start = time.perf_counter()
        target.copy_(source)
        rows["memcpy"].append(slowest(time.perf_counter() - start))
        dist.barrier()
        start = time.perf_counter()
        offset = 0
        for storage in storages:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            target[offset : offset + whole.numel()].copy_(whole)
            offset += whole.numel()
        rows["tensors"].append(slowest(time.perf_counter() - start))
    staged = saves.staged_bytes
    saves.close()
    latest = store.root / (store.root / "latest").read_text()
    size = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rows": rows, "bytes": size, "staged": staged}, f)
    dist.destroy_process_group()


def state_storages(files):
    """Each storage the save's tensors view, once (a DTensor's, of its local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    found = {}

    def visit(value):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            found[(storage.data_ptr(), storage.nbytes())] = storage
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(files.trees)
    visit(files.distributed)
    return list(found.values())


def dd_rate(directory: Path, nbytes: int) -> float:
    """The disk's sequential write rate (bytes/s) for `nbytes`, fsynced, as dd reports it."""
    target = directory / "dd.bin"
    count = max(1, nbytes // 2**24)
    start = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    target.unlink()
    return count * 2**24 / seconds


def main() -> None:
    import json

    import torch.multiprocessing as mp

    parser = bench_parser(__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 8)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--engine", choices=["zero1", "fsdp2"], default="zero1")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary dir)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        out = str(tmp / "rows")
        mp.spawn(rank_main, args=(str(tmp / "store"), args, str(tmp / "run"), out), nprocs=WORLD)
        results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
        rows, size = results[0]["rows"], results[0]["bytes"]
        disk = dd_rate(tmp, size)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in rows.items()}
    print(
        f"checkpoint {size / 1e6:,.0f} MB ({args.engine}, {WORLD} CPU ranks), "
        f"median of {args.saves} saves each way"
    )
    print("| save | training stalled | written after | commit | throughput |")
    print("|---|---|---|---|---|")
    print(
        f"| synchronous | {median['sync']:.2f} s | - | - | "
        f"{size / median['sync'] / 1e6:,.0f} MB/s |"
    )
    written = median["async"] + median["written"]
    print(
        f"| asynchronous | {median['async']:.2f} s ({median['async'] / median['sync']:.0%} of "
        f"synchronous) | {median['written']:.2f} s | {median['commit'] * 1e3:.0f} ms | "
        f"{size / written / 1e6:,.0f} MB/s |"
    )
    print(f"| dd (bs=16M, conv=fsync) | - | - | - | {disk / 1e6:,.0f} MB/s |")
    staged = max(r["staged"] for r in results)
    for key, what in (
        ("memcpy", "one memory copy of a rank's staged bytes"),
        ("tensors", "its state's tensors, each copied once"),
    ):
        ratio = statistics.median(a / f for a, f in zip(rows["async"], rows[key], strict=True))
        print(
            f"| {what} ({staged / 1e6:,.0f} MB) | {median[key]:.3f} s (the asynchronous stall "
            f"is {ratio:.2f}x) | - | - | {staged / median[key] / 1e6:,.0f} MB/s |"
        )


if __name__ == "__main__":
    main()
