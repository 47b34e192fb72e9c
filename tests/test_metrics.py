"""The trace components in one process: FLOP accounting, CPU memory timelines, the memory
trace's figure, and a StepTracer driving a small model through traced and untraced steps (1-rank gloo group);
in a child process, the tracer and the summary without the view extra."""

import io
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from matplotlib.colors import to_hex
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboardX import SummaryWriter

from slurm_autosp.commands.summary import summarize
from slurm_autosp.config import ModelConfig, TraceConfig, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.metrics import StepTracer
from slurm_autosp.metrics.flops import count_flops, peak_tflops
from slurm_autosp.metrics.plot import PEAK, PEAK_MARK, PHASE_COLORS, memory_trace_figure
from slurm_autosp.metrics.rank_memory import MemoryReader, MemoryTimeline, MemoryTrace
from slurm_autosp.model import build_model, build_skeleton

MIB = 2**20
REPO = Path(__file__).resolve().parents[1]


def tiny_llama(layers=2):
    """The config's default model (a Llama of 64 hidden, 4 heads, 2 KV heads, vocab 256)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(num_hidden_layers=layers, extra={"use_cache": False}))


def test_flop_count_is_six_n_per_token_plus_causal_attention():
    model = tiny_llama()
    flops = count_flops(model, seq_len=256, sequences_per_step=4)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64  # q, o; k, v; mlp; two norms
    # final norm, lm_head (the input embedding is not a matmul)
    dense = 2 * per_layer + 64 + 256 * 64
    assert flops.dense_params == dense
    assert flops.per_sequence == 6 * dense * 256 + 6 * 2 * 64 * 256**2  # causal: half of 12*L*d*S^2
    assert flops.per_step == 4 * flops.per_sequence


@pytest.mark.parametrize("family,shared", [("mixtral", False), ("qwen2_moe", True)])
def test_moe_flops_count_the_experts_a_token_runs_not_all_of_them(family, shared):
    """Each token runs top_k of the E routed experts (and any shared expert): the FLOPs count
    those; the memory plan counts every expert."""
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", f"model.model_type={family}"])
    model = build_skeleton(cfg.model)
    experts, top_k = model.num_experts, model.config.num_experts_per_tok
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    everything = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    flops = count_flops(model, seq_len=256, sequences_per_step=1)
    assert flops.idle_expert_params == routed * (experts - top_k) // experts
    assert flops.dense_params == everything - embedding - flops.idle_expert_params
    assert any(".shared_expert." in n for n, _ in model.named_parameters()) == shared
    assert "routed experts a token skips" in flops.describe()


def test_cpu_has_no_peak_flops_unless_configured():
    assert peak_tflops(None, torch.device("cpu"), bf16=False)[0] is None
    assert peak_tflops(400.0, torch.device("cpu"), bf16=False) == (
        400.0,
        "trace.peak_tflops_per_gpu",
    )


def test_cpu_timeline_keeps_a_peak_that_falls_between_samples():
    timeline = MemoryTimeline(
        MemoryReader(torch.device("cpu")), rank=0, step=1, interval_s=0, model=None
    )
    timeline.start()
    timeline.phase_start("forward")
    block = torch.ones(32 * MIB // 4)  # 32 MiB, written, so resident; freed before the next sample
    del block
    timeline.phase_end("forward")
    trace = timeline.stop()
    forward_end = trace.times.index(trace.marks[2][0])
    assert trace.peak[forward_end] - trace.current[0] >= 30 * MIB
    assert trace.current[forward_end] - trace.current[0] < 16 * MIB
    assert trace.where_peak().startswith("in forward")


def test_a_traced_step_samples_memory_every_few_milliseconds():
    """Each sample runs beside the step it measures, holding the GIL: every millisecond (the old
    default) is 200 samples in this step; the peaks stay exact at any interval (each reading
    resets the peak), so sample every 5 ms."""
    interval_s = TraceConfig().memory_sample_ms / 1e3
    timeline = MemoryTimeline(
        MemoryReader(torch.device("cpu")), rank=0, step=1, interval_s=interval_s, model=None
    )
    step_s = 0.2
    timeline.start()
    time.sleep(step_s)
    trace = timeline.stop()
    assert interval_s >= 0.005
    assert len(trace.times) <= step_s / 0.005 + 2  # and the start and end marks


def test_gpu_memory_is_read_from_the_allocators_nested_counters(monkeypatch):
    """memory_stats() and memory_allocated(), which calls it, flatten and sort every counter in
    Python on each call (torch/cuda/memory.py): the reader takes the nested statistics as the
    allocator gives them. An allocator's statistics stand in for the GPU this machine lacks."""
    stats = {
        pool: {
            f"{what}_bytes": {"current": 3 * MIB, "peak": 5 * MIB, "allocated": 0, "freed": 0}
            | ({"peak": 7 * MIB} if what == "reserved" else {})
            for what in ("allocated", "reserved", "active")
        }
        for pool in ("all", "small_pool", "large_pool")
    }
    nested = {key: {pool: stats[pool][key] for pool in stats} for key in stats["all"]}
    nested["num_ooms"] = 0
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device: nested)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: nested)
    flat = torch.cuda.memory_stats(torch.device("cuda", 0))  # torch's own flattening of them
    expected = tuple(
        flat[k]
        for k in (
            "allocated_bytes.all.current",
            "allocated_bytes.all.peak",
            "reserved_bytes.all.peak",
        )
    )

    def flattening(device=None):
        raise AssertionError("memory_stats() flattens every counter in Python")

    monkeypatch.setattr(torch.cuda, "memory_stats", flattening)
    monkeypatch.setattr(torch.cuda, "memory_allocated", flattening)
    assert MemoryReader(torch.device("cuda", 0)).read() == expected == (3 * MIB, 5 * MIB, 7 * MIB)


def test_memory_trace_figure_shades_phases_and_marks_the_peak():
    phases = [
        ("data", 0.0, 0.002),
        ("forward", 0.002, 0.010),
        ("backward", 0.010, 0.020),
        ("optimizer", 0.020, 0.024),
    ]
    times = [0.001, 0.002, 0.006, 0.010, 0.015, 0.020, 0.024]
    current = [m * MIB for m in (100, 100, 140, 180, 150, 120, 120)]
    peak = current[:4] + [230 * MIB] + current[5:]  # freed before the sample at 15 ms
    trace = MemoryTrace(3, 7, "rss", "test", times, current, peak, phases=phases)
    (ax,) = memory_trace_figure(trace, role="worst_rank").axes

    spans = sorted(
        (p.get_x(), p.get_x() + p.get_width(), to_hex(p.get_facecolor())) for p in ax.patches
    )
    assert [color for *_, color in spans] == [PHASE_COLORS[name] for name, *_ in phases]
    assert [x for *xs, _ in spans for x in xs] == pytest.approx(
        [1e3 * t for _, *ts in phases for t in ts]
    )
    marks = [line for line in ax.lines if to_hex(line.get_color()) == PEAK_MARK]
    # the vertical line (two points) and the square on the peak, all at 15 ms
    assert [float(x) for line in marks for x in line.get_xdata()] == pytest.approx([15.0] * 3)
    (square,) = [line for line in marks if line.get_marker() == "s"]
    assert list(square.get_ydata()) == [230]
    assert "230.0 MiB" in [text.get_text() for text in ax.texts]
    (between,) = [c for c in ax.collections if to_hex(c.get_color()[0]) == PEAK]
    assert [seg.tolist() for seg in between.get_segments()] == [[[15.0, 150.0], [15.0, 230.0]]]
    assert ax.get_title(loc="left") == "rank 3 (worst_rank), step 7: peak 230.0 MiB rss in backward"
    assert "ms" in ax.get_xlabel() and "MiB" in ax.get_ylabel()


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_steps(tracer, model, optimizer, steps, during_step=lambda: None):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for step in steps:
        with tracer.step(step) as phases:
            with phases("data"):
                batch = ids.clone()
            with phases("forward"):
                loss = model(input_ids=batch, labels=batch).loss
            during_step()
            with phases("backward"):
                loss.backward()
            with phases("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
        tracer.log_step(step, loss.item(), 1e-3, 1.0)


def test_step_tracer_writes_scalars_and_traces_only_traced_steps(tmp_path, one_rank_group):
    cfg = load_config(
        [f"run.output_root={tmp_path}", "run.name=unit", "trace.memory_steps=[2]", "train.steps=3"]
    )
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = StepTracer(
        cfg, 0, 1, torch.device("cpu"), model, first_step=0, layout="layout: 1 rank"
    )
    seen = {}

    def record_hooks_and_threads():
        step = len(seen) + 1
        seen[step] = (
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
            {t.name for t in threading.enumerate()},
        )

    run_steps(tracer, model, optimizer, [1, 2, 3], record_hooks_and_threads)
    tracer.close()
    assert seen[1][0] == seen[3][0] == 0 and "memory-trace" not in seen[1][1] | seen[3][1]
    assert seen[2][0] > 0 and "memory-trace" in seen[2][1]  # the traced step, and only it
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    events = EventAccumulator(str(RunDir(cfg.run.dir).tensorboard))
    events.Reload()
    tags = events.Tags()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert {
        "memory/peak_rss_mib/max",
        "memory/worst_rank",
        "time/forward_backward_s",
        "throughput/tflops_per_device",
    } <= set(tags["scalars"])
    assert "throughput/mfu_pct" not in tags["scalars"]  # CPU: no peak FLOP/s
    assert {"memory_trace/rank_0", "memory_trace/worst_rank"} <= set(tags["images"])
    assert [e.step for e in events.Images("memory_trace/rank_0")] == [2]
    (image,) = events.Images("memory_trace/rank_0")
    pixels = imread(io.BytesIO(image.encoded_image_string), format="png")
    assert pixels.shape == (image.height, image.width, 3) == (380, 960, 3)
    assert sorted(p.name for p in RunDir(cfg.run.dir).memory_traces.iterdir()) == [
        "step_00000002.json",
        "step_00000002_rank0.png",
    ]
    picture = RunDir(cfg.run.dir).memory_traces / "step_00000002_rank0.png"
    assert imread(picture).shape[:2] == (380, 960)


def test_traced_step_leaves_compiled_layers_alone(tmp_path, one_rank_group):
    """Hooks on a compiled module would make torch.compile recompile: the timeline hooks only
    the modules around the compiled decoder layers, and no step compiles anything new."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    cfg = load_config(
        [
            f"run.output_root={tmp_path}",
            "run.name=compiled",
            "trace.memory_steps=[2]",
            "train.steps=3",
        ]
    )
    model = tiny_llama()
    for layer in model.model.layers:
        layer.compile(backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracer = StepTracer(
        cfg, 0, 1, torch.device("cpu"), model, first_step=0, layout="layout: 1 rank"
    )
    run_steps(tracer, model, optimizer, [1])
    compiled_after_first_step = dict(counters["frames"])
    run_steps(tracer, model, optimizer, [2, 3])
    tracer.close()
    assert dict(counters["frames"]) == compiled_after_first_step
    traced = RunDir(cfg.run.dir).memory_traces / "step_00000002.json"
    trace = json.loads(traced.read_text())["traces"][0]
    labels = {label for _, label in trace["marks"]}
    assert {
        "model.embed_tokens forward",
        "lm_head forward",
        "lm_head backward",
        "model.embed_tokens backward",
    } <= labels
    assert not any(label.startswith("model.layers") for label in labels)


# As if the view extra were not installed: an import of the module fails as a missing one does.
WITHOUT = 'import sys; sys.modules["{module}"] = None\n'

TRACED_WITHOUT_MATPLOTLIB = textwrap.dedent(
    """
    import logging
    import torch
    import torch.distributed as dist
    from slurm_autosp.config import ModelConfig, load_config
    from slurm_autosp.metrics import StepTracer
    from slurm_autosp.model import build_model

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    root = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    cfg = load_config(
        [f"run.output_root={root}", "run.name=unit", "trace.memory_steps=[1,2]", "train.steps=2"]
    )
    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=1, extra={"use_cache": False}))
    tracer = StepTracer(cfg, 0, 1, torch.device("cpu"), model, first_step=0, layout="1 rank")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    for step in (1, 2):
        with tracer.step(step) as phases:
            with phases("forward"):
                loss = model(input_ids=ids, labels=ids).loss
            with phases("backward"):
                loss.backward()
        tracer.log_step(step, loss.item(), 1e-3, 1.0)
    tracer.close()
    dist.destroy_process_group()
    assert sys.modules["matplotlib"] is None  # nothing imported it after all
    """
)


@pytest.mark.slow
def test_a_tracer_without_matplotlib_writes_the_traces_text_and_json_and_warns_once(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT.format(module="matplotlib") + TRACED_WITHOUT_MATPLOTLIB,
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "matplotlib is not installed" in line]
    assert len(warnings) == 1 and "pip install 'slurm_autosp[view]'" in warnings[0], proc.stderr
    run = RunDir(tmp_path / "unit")
    assert sorted(p.name for p in run.memory_traces.iterdir()) == [
        "step_00000001.json",
        "step_00000002.json",
    ]
    events = EventAccumulator(str(run.tensorboard))
    events.Reload()
    assert not events.Tags()["images"]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    text = events.Tensors("memory_trace/rank_0/text_summary")
    assert [e.step for e in text] == [1, 2]
    assert "peak" in text[-1].tensor_proto.string_val[0].decode()
    assert "step 2 rank 0 (rank_0, worst_rank): peak " in summarize(run.root)
    assert "no image (matplotlib was not installed where it ran)" in summarize(run.root)


def test_the_summary_prints_the_held_out_evaluations_beside_the_steps(tmp_path):
    writer = SummaryWriter(str(RunDir(tmp_path).tensorboard))
    for step in range(1, 5):
        writer.add_scalar("train/loss", 6.0 - step, step)
    for step, loss in ((2, 4.5), (4, 3.25)):
        writer.add_scalar("eval/loss", loss, step)
        writer.add_scalar("eval/perplexity", math.exp(loss), step)
    writer.close()
    summary = summarize(tmp_path)
    table = summary[summary.index("held-out evaluation") :].splitlines()
    assert table[1].split() == ["step", "loss", "perplexity"]
    assert table[2].split() == ["2", "4.5000", "90.02"]
    assert table[3].split() == ["4", "3.2500", "25.79"]


@pytest.mark.slow
def test_the_summary_without_tensorboard_says_which_extra_in_one_line(tmp_path):
    summary = "from slurm_autosp.commands.summary import main; sys.exit(main([sys.argv[1]]))"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT.format(module="tensorboard") + summary, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and not proc.stdout  # refused, as every command refuses
    assert proc.stderr.strip().splitlines() == [
        "error: python -m slurm_autosp summary reads the events with TensorBoard, which is not "
        "installed: pip install 'slurm_autosp[view]'"
    ]
