"""The probe times a collective as nccl-tests does: each sample is CALLS back-to-back calls
between two readings of one timer (the host clock on CPU, CUDA events on GPU), never one call
between a barrier and a synchronize, whose launch latency and barrier skew would be as long as
an NVLink transfer. Checked on 2 real gloo ranks."""

import statistics
from pathlib import Path

import pytest
import torch

from slurm_autosp.config import load_config
from slurm_autosp.memory_plan.terms import model_size
from slurm_autosp.probe.collectives import CollectiveTiming, step_messages
from slurm_autosp.probe.timing import CALLS, SAMPLES, WARMUP
from tests._dist_pool import dist_pools as dist_pools  # the session's pools

NBYTES = 1 << 16
# nccl-tests' bus bandwidth factors for n ranks (doc/PERFORMANCE.md): what crosses each link
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
BUS["all_to_all"] = BUS["reduce_scatter"]
BUS["send_recv"] = lambda n: 1.0  # nccl-tests' sendrecv: each byte crosses one link


@pytest.fixture(scope="module")
def pool2(dist_pools):
    return dist_pools(2)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_a_sample_is_calls_back_to_back_and_the_time_is_per_call(pool2, collective):
    for rank in pool2.run("probe_cases:timed_calls", collective, NBYTES):
        spans = rank["spans"]
        assert len(spans) == WARMUP + SAMPLES * CALLS
        samples = [spans[WARMUP + k * CALLS : WARMUP + (k + 1) * CALLS] for k in range(SAMPLES)]
        # the timer brackets the sample's calls: from the first call's start to the last's end
        per_call = statistics.median((calls[-1][1] - calls[0][0]) / CALLS for calls in samples)
        assert rank["seconds"] == pytest.approx(per_call, rel=0.1)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_to_all", "send_recv"])
def test_bus_bandwidth_is_nccl_tests_formula_over_the_time_per_call(pool2, collective):
    for rank in pool2.run("probe_cases:timed_calls", collective, NBYTES):
        sent, seconds, latency = rank["message"]
        timing = CollectiveTiming(
            collective, "test", "dp", 0, 2, sent, seconds, latency, CALLS, None, ""
        )
        assert sent == NBYTES and 0 < latency and 0 < seconds
        assert timing.algbw_gb_per_s == pytest.approx(NBYTES / seconds / 1e9)
        assert timing.busbw_gb_per_s == pytest.approx(NBYTES / seconds / 1e9 * BUS[collective](2))


def test_under_a_ring_the_all_to_alls_are_the_ulysses_groups_and_the_ring_passes_its_blocks():
    """tiny_cpu (4 query heads, 2 KV heads, head_dim 16, 256 tokens, micro-batch 2, fp32) as
    SP=4 = Ulysses 2 x ring 2: the all-to-alls carry a rank's 64 tokens (no KV repeat over 2
    Ulysses ranks); a ring block is K and V of 1 KV head over 128 tokens, dK/dV in fp32."""
    tiny = f"cfg={Path(__file__).parents[1] / 'configs' / 'tiny_cpu.yaml'}"
    cfg = load_config(
        [tiny, "parallel.sp_size=4", "parallel.ring_size=2", "cluster.tasks_per_node=4"]
    )
    messages = {(m.collective, m.what, m.group): m.nbytes for m in step_messages(cfg, 1)}
    assert messages[("all_to_all", "q / attention out", "sp")] == 2 * 4 * 64 * 16 * 4
    assert messages[("all_to_all", "k / v", "sp")] == 2 * 2 * 64 * 16 * 4
    assert messages[("send_recv", "ring k / v block", "ring")] == 2 * 2 * 1 * 128 * 16 * 4
    assert messages[("send_recv", "ring dk / dv (fp32)", "ring")] == 2 * 2 * 1 * 128 * 16 * 4
    ulysses_only = load_config([tiny, "parallel.sp_size=2", "parallel.ring_size=1"])
    assert all(m.group != "ring" for m in step_messages(ulysses_only, 1))


def _reduction(*overrides, stage):
    cfg = load_config(
        [f"cfg={Path(__file__).parents[1] / 'configs' / overrides[0]}", *overrides[1:]]
    )
    return [m for m in step_messages(cfg, stage) if m.group == "world"]


def test_the_gradient_reduction_is_timed_over_every_rank_in_fp32_as_each_engine_sends_it():
    """SP ranks reduce gradients too (DP=1 at SP=2 still reduces over both), always in fp32:
    DeepSpeed's BF16_Optimizer all-reduces its flat fp32 gradient whole (one parameter group:
    one tensor past reduce_bucket_size; 32 GB at Llama-8B), its fp32 optimizer reduce-scatters
    buckets of 5e8, FSDP2 reduce-scatters one layer and never all-reduces."""
    [bf16] = _reduction("llama8b_32k.yaml", stage=1)
    assert (bf16.collective, bf16.dtype) == ("all_reduce", torch.float32)
    assert bf16.nbytes == model_size(load_config(["cfg=configs/llama8b_32k.yaml"]).model).total * 4
    [fp32] = _reduction("llama8b_32k.yaml", "train.precision=fp32", stage=1)
    assert (fp32.collective, fp32.nbytes) == ("reduce_scatter", 500_000_000 * 4)
    [layer] = _reduction("llama8b_32k.yaml", stage=3)
    assert (layer.collective, layer.dtype) == ("reduce_scatter", torch.float32)
    assert layer.nbytes == 218_112_000 * 4  # one Llama-8B decoder layer
    tiny = f"cfg={Path(__file__).parents[1] / 'configs' / 'tiny_cpu.yaml'}"
    sp_only = load_config([tiny, "parallel.sp_size=2", "cluster.tasks_per_node=2"])
    assert sp_only.dp_size == 1
    assert [m.group for m in step_messages(sp_only, 1)].count("world") == 1
    alone = load_config([tiny, "parallel.sp_size=1", "cluster.tasks_per_node=1"])
    assert all(m.group != "world" for m in step_messages(alone, 1))
