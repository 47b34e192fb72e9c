"""The memory plan: per-GPU terms and a verdict for the shipped configs, and predicted
activation memory against what a CPU run actually holds."""

import multiprocessing as mp
import os

import pytest
import torch

from slurm_autosp.config import load_config
from slurm_autosp.plan import build_plan, plan_verdict
from slurm_autosp.plan.memory import render, verdict

TERMS = ("parameters", "gradients", "optimizer_shard", "activations", "logits_and_loss", "communication",
         "recompute_working", "fragmentation_margin", "total")


@pytest.fixture(scope="module")
def llama70b_plan():
    return build_plan(load_config(["cfg=configs/llama70b_128k.yaml"]))


def test_llama70b_under_zero1_does_not_fit_because_of_full_weights_and_gradients(llama70b_plan):
    text, fits, reason = verdict(llama70b_plan)
    assert not fits
    assert "parameters" in reason and "282 GB" in reason, reason
    assert "zero_stage=3" in text, text  # what would fit names parameter sharding
    assert llama70b_plan.configured.trace.quadratic_saved == []


def test_plan_prints_every_term_and_the_longest_sequence_per_policy(llama70b_plan):
    text = render(llama70b_plan)
    for term in TERMS:
        assert term in text, term
    for policy in ("none", "torch_default", "full", "sac (budget 0)"):
        assert f"  {policy} " in text, policy


def test_llama8b_32k_fits_with_sac():
    text, fits, reason = plan_verdict(load_config(["cfg=configs/llama8b_32k.yaml"]))
    assert fits and "verdict: fits" in text and reason == "", text


def test_cpu_jobs_always_fit_without_tracing():
    text, fits, _ = plan_verdict(load_config(["cfg=configs/tiny_cpu.yaml"]))
    assert fits and "CPU" in text


# ----------------------------------------------------------------------------- measured on CPU

SEQS = (2048, 4096)


def _forward_rss(seqs, budget, queue):
    """In a fresh process (SP=1, one gloo rank): VmRSS after minus before the forward of the
    second step at each length, the model compiled per layer with SAC at `budget`."""
    import torch.distributed as dist

    from slurm_autosp.compile import AutoSPBackend, compile_model, prepare_sp_inputs, set_sp_group
    from slurm_autosp.compile.checkpointing import CheckpointSpec
    from slurm_autosp.compile.chunked_loss import causal_lm_loss
    from slurm_autosp.model import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['PLAN_TEST_STORE']}", rank=0, world_size=1)
    set_sp_group(dist.group.WORLD)
    cfg = load_config(["model.num_hidden_layers=4"])
    model = build_model(cfg.model)
    compile_model(model, AutoSPBackend(1, CheckpointSpec("sac", budget=budget)), per_layer=True)

    def rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    measured = {}
    for seq in seqs:
        batch = prepare_sp_inputs(torch.randint(1, 256, (1, seq)), sp_rank=0, sp_size=1)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            before = rss()
            loss = causal_lm_loss(model, batch.model_kwargs(seq - 1), chunk_tokens=256)
            measured[seq] = rss() - before
            loss.backward()
    dist.destroy_process_group()
    queue.put(measured)


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_predicted_activation_memory_is_within_15_percent_of_measured_on_cpu(tmp_path, budget):
    """Measured: the resident set grows by what the forward keeps for backward (glibc returns
    freed blocks of 64 KiB or more at once with MALLOC_MMAP_THRESHOLD_). Predicted: the plan's
    activations and final-norm/loss inputs, from the partitioned joint graph of one layer."""
    from slurm_autosp.compile.checkpointing import CheckpointSpec
    from slurm_autosp.plan.trace import trace_decoder_layer

    context = mp.get_context("spawn")
    queue = context.Queue()
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "PLAN_TEST_STORE": str(tmp_path / "store"), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        process = context.Process(target=_forward_rss, args=(SEQS, budget, queue))
        process.start()
        measured = queue.get(timeout=900)
        process.join(60)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    cfg = load_config(["model.num_hidden_layers=4"])
    hidden, layers = cfg.model.hidden_size, cfg.model.num_hidden_layers
    for seq in SEQS:
        (trace,) = trace_decoder_layer(cfg.model, local_seq=seq, sp_size=1, dtype=torch.float32,
                                       specs=[CheckpointSpec("sac", budget=budget)])
        final_norm_and_loss = hidden * 4 + 4 + hidden * 4 + 8 + 8
        predicted = layers * trace.activation_bytes + trace.shared_bytes + final_norm_and_loss * seq
        error = (predicted - measured[seq]) / measured[seq]
        print(f"budget {budget} seq {seq}: predicted {predicted / 2**20:.2f} MiB, measured {measured[seq] / 2**20:.2f} MiB ({error:+.1%})")
        assert abs(error) <= 0.15, f"seq {seq}: predicted {predicted} B, measured {measured[seq]} B ({error:+.1%})"
