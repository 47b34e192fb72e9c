"""Optimizer-state offload as the plan sees it: the key, the engines' settings, the rungs of the
ladder that move the state to host memory (GPU bytes freed, host bytes shared with activation
offload, the step cost), and that `auto` takes them only when nothing else fits. Training with
it equals training without: tests/compile/test_optimizer_offload_steps.py."""

import re

import pytest

from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.engine.deepspeed_zero1 import deepspeed_config
from slurm_autosp.memory_plan import build_plan, render
from slurm_autosp.memory_plan.choose import choices_from_plan
from slurm_autosp.memory_plan.freeze import FROZEN_KEYS, freeze_choices
from slurm_autosp.memory_plan.offload_cost import (
    ADAM_BYTES_PER_PARAMETER,
    HOST_MEMORY_GB_PER_S,
    optimizer_offload_cost,
)
from slurm_autosp.memory_plan.policies import Rung, ladder
from slurm_autosp.memory_plan.terms import FRAGMENTATION, GB, HOST_USABLE
from slurm_autosp.sp.host_arena import SLAB_BYTES

# Llama-3.1-8B on one node of 8 x 80 GB with 2 TB of host memory: 4.9M tokens is past what the
# activation-offload rungs fit (4.75M), within what optimizer offload adds (5.27M)
LONG_8B = ["cfg=configs/llama8b_4m.yaml", "data.seq_len=5111808"]


@pytest.fixture(scope="module")
def long_plan():
    return build_plan(load_config(LONG_8B))


@pytest.fixture(scope="module")
def plan_4m():
    return build_plan(load_config(["cfg=configs/llama8b_4m.yaml"]))


def test_offload_optimizer_is_left_to_the_plan_and_a_bad_value_names_the_key():
    assert load_config([]).parallel.offload_optimizer is None
    assert load_config(["parallel.offload_optimizer=true"]).parallel.offload_optimizer is True
    with pytest.raises(ConfigError, match=r"parallel\.offload_optimizer.*'maybe'"):
        load_config(["parallel.offload_optimizer=maybe"])


def test_zero1_offloads_through_deepspeed_with_the_client_torch_optimizer():
    cfg = load_config([])
    offloaded = deepspeed_config(cfg, offload_optimizer=True)
    assert offloaded["zero_optimization"] == {
        "stage": 1,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    }
    assert offloaded["zero_force_ds_cpu_optimizer"] is False  # our torch AdamW, not CPUAdam
    assert "offload_optimizer" not in deepspeed_config(cfg, False)["zero_optimization"]


def test_a_configured_value_fixes_optimizer_offload_on_every_rung():
    on = ladder(load_config(["cfg=configs/llama8b_32k.yaml", "parallel.offload_optimizer=true"]))
    off = ladder(load_config(["cfg=configs/llama8b_32k.yaml", "parallel.offload_optimizer=false"]))
    assert all(r.offload_optimizer for r in on) and not any(r.offload_optimizer for r in off)
    assert len(on) == len(off)


def test_auto_does_not_offload_the_optimizer_when_the_job_fits_without(plan_4m):
    memory = plan_4m.configured
    assert plan_4m.fits and not memory.rung.offload_optimizer, memory.label
    assert memory.host_fixed == SLAB_BYTES  # the activation offload's arena: no optimizer state
    assert "optimizer offload:" not in render(plan_4m)


def test_auto_offloads_the_optimizer_when_nothing_else_fits(long_plan):
    memory = long_plan.configured
    assert long_plan.fits and long_plan.zero_stage == 3, render(long_plan)
    assert memory.rung == Rung(memory.spec, tiled=True, offload=True, offload_optimizer=True), (
        memory.label
    )
    earlier = [r for r in ladder(long_plan.cfg) if not r.offload_optimizer]
    assert not any(long_plan.memories[3][r].fits(long_plan.gpu_bytes) for r in earlier)
    assert choices_from_plan(long_plan).offload_optimizer


def test_zero3_offload_moves_the_fp32_shards_gradients_and_moments_to_the_host(long_plan):
    """16 bytes per parameter over the world leave the GPU and count against the same host
    memory as the offloaded activations: the host-bound longest sequence shrinks by them."""
    memory = long_plan.configured
    resident = long_plan.memories[3][Rung(memory.spec, tiled=True, offload=True)]
    state = 16 * long_plan.parameters / 8
    for name in ("parameters", "gradients", "optimizer_shard"):
        assert memory.terms[name] == 0 and resident.terms[name] > 0
    assert resident.total - memory.total == pytest.approx(state * (1 + FRAGMENTATION))
    assert memory.host_fixed == pytest.approx(state + SLAB_BYTES)
    assert memory.host_bytes == pytest.approx(state + resident.host_bytes)
    assert memory.host_bytes_per_rank == 2048 * GB * HOST_USABLE / 8
    host_bound = int((memory.host_bytes_per_rank - state - SLAB_BYTES) // memory.host_per_token)
    assert memory.longest_local_seq(long_plan.gpu_bytes) <= host_bound


def test_zero1_offload_moves_the_optimizer_shard_and_stages_the_parameters_on_the_host(
    long_plan,
):
    rung = long_plan.configured.rung
    zero1 = long_plan.memories[1][rung]
    params = long_plan.parameters
    assert zero1.terms["optimizer_shard"] == 0 and zero1.terms["parameters"] == 2 * params
    assert zero1.host_fixed == pytest.approx((16 + 2) * params / 8 + SLAB_BYTES)


def test_the_plan_prints_the_rung_its_host_memory_and_step_cost(long_plan):
    text = render(long_plan)
    assert re.search(
        r"full \(all-to-all recomputed\) \+ tiled layers \+ offload \+ optimizer offload +"
        r"ZeRO-1: +[\d,]+ +ZeRO-3: +[\d,]+ +needs +[\d.]+ GB +<- chosen",
        text,
    ), text
    assert re.search(
        r"optimizer offload: [\d,]+ GB of host memory per node \([\d,]+ GB offloaded in all\); "
        r"per step [\d,]+ ms of copies at 25 GB/s \(hidden behind the layers\) and [\d,]+ ms of "
        r"host AdamW: \+[\d.]+% on the step's [\d,.]+ s of compute",
        text,
    ), text


def test_the_step_cost_is_the_host_adam_over_the_node_share_of_the_parameters(long_plan):
    cost = optimizer_offload_cost(long_plan)
    per_node = long_plan.parameters / long_plan.cfg.cluster.nodes
    assert cost.adam_seconds == pytest.approx(
        ADAM_BYTES_PER_PARAMETER * per_node / (HOST_MEMORY_GB_PER_S * GB)
    )
    assert cost.hidden and cost.exposed_seconds == cost.adam_seconds
    assert cost.exposed_seconds < 0.01 * cost.compute_seconds  # minutes of compute per step


def test_the_choice_is_frozen_into_the_config(long_plan):
    cfg = freeze_choices(load_config(LONG_8B), choices_from_plan(long_plan))
    assert ("parallel", "offload_optimizer") in FROZEN_KEYS
    assert cfg.parallel.offload_optimizer is True
