"""What tracing costs a training step: no tracer, untraced steps, traced steps.

    python bench/trace_bench.py              # Llama hidden 128, 4 layers, 2 x 256 tokens, 40 rounds
    python bench/trace_bench.py --quick      # fewer rounds

One process, a 1-rank gloo group, the model uncompiled (so every module within three levels of
the root gets memory hooks: the dearest case), fp32 AdamW; on a GPU when there is one. Each
round runs one step of each kind in a shuffled order, so drifting machine load hits all three
alike.
- bare: forward, backward and optimizer step, nothing else;
- untraced: the same inside `StepTracer.step()` with phase timing, then `log_step` (the
  per-step all-gather and the TensorBoard scalars): what every step pays;
- traced: the same on a step in `trace.memory_steps`: timeline sampling thread, module hooks,
  phase marks, and at `log_step` the trace gathered, drawn, PNG-encoded and written.
Last, 200 empty untraced steps measure the tracer's own bookkeeping without a model, and 2000
memory readings the sampling thread's own cost (samples per traced step x time per reading).
Reported: median wall time and median CPU time (all threads of the process, so the sampling
thread's work counts) of each kind and their difference to bare, in ms and %; then the steps
alone, without `log_step`: how much the tracing distorts the very step it measures (the
sampling thread and the hooks run during it; drawing and writing come after). On a shared,
oversubscribed machine the CPU time is the steadier number: there, wall time also measures how
the scheduler treats a process with one more thread.
"""

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import bench_parser

from slurm_autosp.config import load_config
from slurm_autosp.metrics import StepTracer


def build(device, hidden, layers):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(config).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def one_step(model, optimizer, ids, phases):
    with phases("data"):
        batch = ids.clone()
    with phases("forward"):
        loss = model(input_ids=batch, labels=batch).loss
    with phases("backward"):
        loss.backward()
    with phases("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


class _Untimed:
    def __call__(self, name):
        return self

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def main():
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    rounds = 10 if args.quick else 40
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="trace_bench_"))
    dist.init_process_group(
        "gloo" if device.type == "cpu" else "nccl",
        init_method=f"file://{tmp}/store",
        rank=0,
        world_size=1,
    )
    # Steps 1..rounds are untraced, rounds+1.. traced: one tracer, the loop picks the numbers.
    traced_steps = list(range(rounds + 1, 2 * rounds + 1))
    cfg = load_config(
        [
            f"run.output_root={tmp}",
            "run.name=bench",
            f"data.seq_len={args.seq}",
            "train.micro_batch=2",
            f"train.steps={2 * rounds}",
            "trace.memory_steps=[" + ",".join(map(str, traced_steps)) + "]",
            f"cluster.gpus_per_node={1 if device.type == 'cuda' else 0}",
            "cluster.tasks_per_node=1",
        ]
    )
    model, optimizer = build(device, args.hidden, args.layers)
    tracer = StepTracer(cfg, 0, 1, device, model, first_step=0, layout="1 rank")
    ids = torch.randint(0, 1024, (2, args.seq), device=device)
    for _ in range(3):  # warm up allocator, kernels, optimizer state
        one_step(model, optimizer, ids, _Untimed())

    times = {"bare": [], "untraced": [], "traced": []}
    cpu = {kind: [] for kind in times}
    alone = {kind: [] for kind in times}  # the step without log_step: (wall, CPU)
    samples = []
    order = random.Random(0)
    for r in range(rounds):
        kinds = list(times)
        order.shuffle(kinds)
        for kind in kinds:
            step = {"bare": None, "untraced": r + 1, "traced": rounds + r + 1}[kind]
            start, start_cpu = time.perf_counter(), time.process_time()
            if step is None:
                one_step(model, optimizer, ids, _Untimed())
                alone[kind].append((time.perf_counter() - start, time.process_time() - start_cpu))
            else:
                with tracer.step(step) as phases:
                    loss = one_step(model, optimizer, ids, phases)
                alone[kind].append((time.perf_counter() - start, time.process_time() - start_cpu))
                if kind == "traced":
                    samples.append(len(tracer._last.trace.times))
                tracer.log_step(step, loss, 1e-4, 1.0)
            times[kind].append(time.perf_counter() - start)
            cpu[kind].append(time.process_time() - start_cpu)
    # The tracer's own bookkeeping on an untraced step, without a model to hide it.
    empty = [time.process_time()]
    for step in range(10**6, 10**6 + 200):  # none of them traced
        with tracer.step(step) as phases:
            for name in ("data", "forward", "backward", "optimizer"):
                with phases(name):
                    pass
        tracer.log_step(step, 0.0, 1e-4, 1.0)
    empty.append(time.process_time())
    reading = time.process_time()
    for _ in range(2000):
        tracer.memory.read_and_reset()
    reading = (time.process_time() - reading) / 2000
    tracer.close()
    dist.destroy_process_group()

    bare = statistics.median(times["bare"])
    print(
        f"device {device}, Llama hidden {args.hidden} x {args.layers} layers, 2 x {args.seq} tokens, {rounds} rounds, "
        f"{statistics.median(samples):.0f} memory samples per traced step ({cfg.trace.memory_sample_ms} ms interval)"
    )
    bare_cpu = statistics.median(cpu["bare"])
    for kind in times:
        wall, used = statistics.median(times[kind]), statistics.median(cpu[kind])
        extra = (
            ""
            if kind == "bare"
            else (
                f"   wall {1e3 * (wall - bare):+7.2f} ms ({100 * (wall - bare) / bare:+5.1f}%),"
                f" CPU {1e3 * (used - bare_cpu):+7.2f} ms ({100 * (used - bare_cpu) / bare_cpu:+5.1f}%)"
            )
        )
        print(f"  {kind:9s} wall {1e3 * wall:8.2f} ms, CPU {1e3 * used:8.2f} ms{extra}")
    print("  the step alone, without log_step:")
    bare_wall = statistics.median(w for w, _ in alone["bare"])
    bare_cpu = statistics.median(c for _, c in alone["bare"])
    for kind in ("untraced", "traced"):
        wall = statistics.median(w for w, _ in alone[kind])
        used = statistics.median(c for _, c in alone[kind])
        print(
            f"  {kind:9s} wall {1e3 * (wall - bare_wall):+7.2f} ms ({100 * (wall - bare_wall) / bare_wall:+5.1f}%),"
            f" CPU {1e3 * (used - bare_cpu):+7.2f} ms ({100 * (used - bare_cpu) / bare_cpu:+5.1f}%)"
        )
    sampled = statistics.median(samples) * reading
    print(
        f"  memory sampling alone: {statistics.median(samples):.0f} samples x {1e6 * reading:.0f} us "
        f"= {1e3 * sampled:.2f} ms CPU per traced step ({100 * sampled / bare_cpu:.1f}% of a bare step)"
    )
    print(
        f"  tracer bookkeeping alone on an untraced step (phase clock, memory peak, all-gather, "
        f"scalars event): {1e6 * (empty[1] - empty[0]) / 200:.0f} us CPU"
    )


if __name__ == "__main__":
    main()
