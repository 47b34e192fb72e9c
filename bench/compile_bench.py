"""Compile time, step time and exactness of our AutoSP backend vs DeepSpeed's own `autosp` pass.

    python bench/compile_bench.py            # full: 2, 8 and 32 layers (see below for time)
    python bench/compile_bench.py --quick    # 2 and 8 layers, fewer steps

Same tiny Llama for both (hidden 64, 4 heads, 2 KV heads, vocab 256, fp32, sdpa), SP=2 on two
local ranks (two GPUs with NCCL when there are two, otherwise CPU with gloo), one sequence of
256 tokens, both inside a DeepSpeed ZeRO-1 engine:
- ours: `compile_model(per_layer=True)` with `AutoSPBackend(2)`, inputs from
  `prepare_sp_inputs`, loss scaled by `loss_scale(world, 1)`;
- peer: `{"compile": {"deepcompile": true, "passes": ["autosp"]}, "sequence_parallel_size": 2}`,
  `engine.compile(compile_kwargs={"dynamic": True})`, the full-length inputs tagged by
  `prepare_autosp_inputs` (it shards them inside its graph), HF's default call (with
  `use_cache=False` its pass fails: "expand: attempting to expand a dimension of length s27").
Each (backend, depth) runs twice in new processes: cold (a fresh TORCHINDUCTOR_CACHE_DIR) and warm
(the same cache again). "Compile + first step" is the wall time from the compile call to the end
of the first optimizer step, the slower rank's, as wall time and as CPU time (the rank's process and the C++ compiler runs it
waited for; on a shared machine wall time grows with other users' load, CPU time much less; on
GPU, inductor's pooled compile workers are not counted). Errors compare the first step's loss and its
reduced gradients (what the optimizer would apply) with a single-device fp32 step on the same
batch: relative loss error and the worst parameter's max|g - g_ref| / max|g_ref|.

Time on 2 CPU cores: the full run needs about 12-15 minutes of both cores (its CPU times add up
to that, most of it the peer's 32-layer compile); on a machine shared at load 5-17 it took 42.
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, bench_parser

SP = 2
SEQ = 256
VOCAB = 256


# ----------------------------------------------------------------------------- one rank


def tiny_llama(layers: int, device, use_cache: bool = False):
    """The config's default model (a Llama of 64 hidden, 4 heads, 2 KV heads), `layers` deep.
    Our models are built with `use_cache=False`; `use_cache=True` is HF's default."""
    import torch

    from slurm_autosp.config import ModelConfig
    from slurm_autosp.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=layers, vocab_size=VOCAB))
    model.config.use_cache = use_cache
    return model.to(device)


def reference_step(layers: int, input_ids, device):
    """Single-device fp32 loss and gradients of the plain model on the whole sequence."""
    model = tiny_llama(layers, device)
    out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    out.loss.backward()
    return float(out.loss), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def deepspeed_engine(model, extra_config: dict):
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        **extra_config,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: every step is alike
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


@dataclass(frozen=True)
class Unstepped:
    """The raw DeepSpeed engine as a step runs it, with the factor for its average over the
    world; its optimizer step is left to the bench, which reads the reduced gradients first."""

    engine: Any
    loss_scale: float

    def __call__(self, **kwargs: Any) -> Any:
        return self.engine(**kwargs)

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        pass


def setup_ours(layers: int, input_ids, device):
    """Returns (engine, compile, step, how rank losses combine): `step()` runs forward and
    backward and returns this rank's loss, its summed token loss over the global label count
    (so the ranks' sum is the step's loss)."""
    import torch.distributed as dist

    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.run_step import run_engine_step
    from slurm_autosp.sp import loss_scale, prepare_sp_inputs, set_sp_group

    world, rank = dist.get_world_size(), dist.get_rank()
    engine = deepspeed_engine(tiny_llama(layers, device), {})
    shard = prepare_sp_inputs(input_ids, sp_rank=rank, sp_size=SP)
    set_sp_group(dist.group.WORLD)
    unstepped = Unstepped(engine, loss_scale(world, grad_accum=1))

    def compile_():
        compile_model(engine.module, AutoSPBackend(SP), per_layer=True)

    def step():
        return run_engine_step(unstepped, [shard], SP, 1).micro_batches[0].loss.detach()

    return engine, compile_, step, "sum"


def setup_peer(layers: int, input_ids, device):
    """DeepSpeed's autosp pass, configured as DeepSpeed documents it; it shards the full-length
    inputs inside the compiled graph. Its loss is each rank's mean over its shard; the value it
    reports for the step is their mean."""
    import torch
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

    engine = deepspeed_engine(
        tiny_llama(layers, device, use_cache=True),  # its pass fails on use_cache=False models
        {"compile": {"deepcompile": True, "passes": ["autosp"]}, "sequence_parallel_size": SP},
    )
    labels = input_ids.clone()
    position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
    input_ids, labels, position_ids, _ = prepare_autosp_inputs(input_ids, labels, position_ids)

    def compile_():
        engine.compile(compile_kwargs={"dynamic": True})

    def step():
        out = engine(input_ids=input_ids, labels=labels, position_ids=position_ids)
        engine.backward(out.loss)
        return out.loss.detach()

    return engine, compile_, step, "mean"


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (inductor runs the C++ compiler
    in child processes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rank_main(impl: str, layers: int, steps: int, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    cuda = os.environ["BENCH_DEVICE"] == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    from deepspeed.utils import safe_get_full_grad

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    input_ids = torch.randint(1, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    ref_loss, ref_grads = reference_step(layers, input_ids, device)
    engine, compile_, step, combine = (setup_ours if impl == "ours" else setup_peer)(
        layers, input_ids, device
    )

    def timed(fn):
        """Run `fn` on every rank; (wall s, this process's CPU s) until all ranks are done."""
        sync()
        wall, cpu = time.perf_counter(), cpu_seconds()
        value = fn()
        sync()
        return value, time.perf_counter() - wall, cpu_seconds() - cpu

    loss, wall, cpu = timed(lambda: (compile_(), step())[1])
    # the reduced gradients the optimizer is about to apply (read outside the timed region)
    grads = {
        name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()
    }
    _, step_wall, step_cpu = timed(engine.step)
    first = [wall + step_wall, cpu + step_cpu]

    later = [timed(lambda: (step(), engine.step()))[1:] for _ in range(steps)]

    dist.all_reduce(loss)  # gloo has no AVG
    if combine == "mean":
        loss /= dist.get_world_size()
    medians = [statistics.median(t[i] for t in later) for i in (0, 1)]
    slowest = torch.tensor(first + medians, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    grad_error = max(
        float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in ref_grads.items()
    )
    if dist.get_rank() == 0:
        Path(result_path).write_text(
            json.dumps(
                {
                    "first_step_s": float(slowest[0]),
                    "first_step_cpu_s": float(slowest[1]),
                    "median_step_ms": 1000 * float(slowest[2]),
                    "median_step_cpu_ms": 1000 * float(slowest[3]),
                    "loss_rel_error": abs(float(loss) - ref_loss) / abs(ref_loss),
                    "grad_rel_error": grad_error,
                }
            )
        )
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- orchestration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    impl: str, layers: int, steps: int, cache_dir: Path, device: str, timeout_s: float
) -> dict:
    """Run one measurement on SP fresh processes; returns rank 0's result or {"error": ...}."""
    from slurm_autosp.cluster.compile_cache import use_private_compile_cache

    result_path = cache_dir / f"result_{impl}_{layers}_{time.monotonic_ns()}.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **use_private_compile_cache(str(cache_dir), inherited={}),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(SP),
        "BENCH_DEVICE": device,
    }
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", TORCHINDUCTOR_COMPILE_THREADS="1")
    command = [
        sys.executable,
        __file__,
        "--rank-main",
        impl,
        str(layers),
        str(steps),
        str(result_path),
    ]
    log_path = cache_dir / f"log_{impl}_{layers}.txt"
    processes = []
    with open(log_path, "ab") as log:
        for rank in range(SP):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            processes.append(
                subprocess.Popen(
                    command,
                    env=rank_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        try:
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout_s:.0f} s"}
        finally:
            for process in processes:  # our own children, each in its own session
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
    if result_path.exists() and all(p.returncode == 0 for p in processes):
        return json.loads(result_path.read_text())
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    return {"error": f"exit codes {[p.returncode for p in processes]}: {' | '.join(tail)}"}


def detect_device(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= SP:
        return "cuda"
    if torch.cuda.is_available():
        print(
            f"only {torch.cuda.device_count()} GPU(s); SP={SP} with NCCL needs {SP}: running on CPU"
        )
    return "cpu"


ROWS = (
    ("cold compile + first step, wall (s)", "cold", "first_step_s", "{:.1f}"),
    ("cold compile + first step, CPU (s)", "cold", "first_step_cpu_s", "{:.1f}"),
    ("warm compile + first step, wall (s)", "warm", "first_step_s", "{:.1f}"),
    ("warm compile + first step, CPU (s)", "warm", "first_step_cpu_s", "{:.1f}"),
    ("median step, wall (ms)", "warm", "median_step_ms", "{:.1f}"),
    ("median step, CPU (ms)", "warm", "median_step_cpu_ms", "{:.1f}"),
    ("loss rel. error", "cold", "loss_rel_error", "{:.1e}"),
    ("max grad rel. error", "cold", "grad_rel_error", "{:.1e}"),
)


def table(results: dict, layer_counts: list[int]) -> str:
    lines = ["| layers | measure | ours | peer | ours/peer |", "|---:|---|---:|---:|---:|"]
    for layers in layer_counts:
        for label, run, key, fmt in ROWS:
            runs = [results.get((impl, layers, run)) for impl in ("ours", "peer")]
            cells = [None if r is None else r.get(key) for r in runs]
            text = [
                "not run" if r is None else "failed" if v is None else fmt.format(v)
                for r, v in zip(runs, cells, strict=True)
            ]
            ratio = f"{cells[0] / cells[1]:.2g}" if None not in cells and cells[1] else "–"
            lines.append(f"| {layers} | {label} | {text[0]} | {text[1]} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="2 and 8 layers, 3 timed steps")
    parser.add_argument("--layers", type=int, nargs="+", help="depths to measure (default 2 8 32)")
    parser.add_argument("--impls", nargs="+", default=["ours", "peer"], choices=["ours", "peer"])
    parser.add_argument(
        "--steps", type=int, help="timed steps after the first (default 5, quick 3)"
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run launch's cleanup on SIGTERM too
    layer_counts = args.layers or ([2, 8] if args.quick else [2, 8, 32])
    steps = args.steps or (3 if args.quick else 5)
    device = detect_device(args.device)
    print(f"device={device} SP={SP} seq={SEQ} layers={layer_counts} steps={steps}", flush=True)

    results = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compile_bench_") as root:
        for impl in args.impls:
            for layers in layer_counts:
                cache_dir = Path(root) / f"{impl}_{layers}"  # fresh per backend and depth
                cache_dir.mkdir()
                for run in ("cold", "warm"):
                    t = time.monotonic()
                    result = launch(impl, layers, steps, cache_dir, device, args.timeout)
                    results[(impl, layers, run)] = result
                    load = os.getloadavg()[0]
                    print(
                        f"[{time.monotonic() - began:6.0f} s] {impl:4s} {layers:2d} layers {run}: "
                        f"{json.dumps(result)} ({time.monotonic() - t:.0f} s with start-up; "
                        f"load {load:.1f} on {os.cpu_count()} cores)",
                        flush=True,
                    )
    print(
        f"\nload average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        "(wall times grow with other load, CPU times much less)\n"
    )
    print(table(results, layer_counts))
    print()
    shallow, deep = min(layer_counts), max(layer_counts)
    for key, what in (("first_step_s", "wall"), ("first_step_cpu_s", "CPU")):
        ours = [results.get(("ours", n, "cold"), {}).get(key) for n in (shallow, deep)]
        if None not in ours and deep > shallow:
            ratio = ours[1] / ours[0]
            print(
                f"ours: cold compile + first step ({what}) at {deep} layers / at {shallow} layers = "
                f"{ratio:.2f} (acceptance <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'})"
            )
    if args.json:
        args.json.write_text(
            json.dumps({f"{i}/{n}/{r}": v for (i, n, r), v in results.items()}, indent=1)
        )


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
