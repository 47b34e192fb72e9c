"""The memory plan: per-GPU terms and a verdict for the shipped configs, and predicted
activation memory against what a CPU run actually holds."""

import multiprocessing as mp
import os

import pytest
import torch
from in_process import run_command
from slurm_helpers import REPO

from slurm_autosp.admission import admit
from slurm_autosp.commands.arguments import REFUSED
from slurm_autosp.commands.plan import main as plan_main
from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
from slurm_autosp.config import ActivationCheckpointing, ConfigError, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.memory_plan import (
    AUTO_CANDIDATES,
    activation_checkpoint_spec_for,
    build_plan,
    plan_verdict,
    render,
    verdict,
    zero_stage_for,
)
from slurm_autosp.memory_plan.layer_graph import trace_decoder_layer
from slurm_autosp.memory_plan.policies import Rung, ladder, spec_label, tile_tokens_for
from slurm_autosp.memory_plan.terms import (
    attention_backward_per_token,
    communicators,
    model_size,
    offload_lag_layers,
    outside_allocator,
    policy_memory,
    ring_blocks_per_token,
)
from slurm_autosp.metrics.outside_allocator import OutsideAllocator
from slurm_autosp.model import build_skeleton
from slurm_autosp.sp.host_arena import SLAB_BYTES

TERMS = (
    "parameters",
    "gradients",
    "optimizer_shard",
    "activations",
    "logits_and_loss",
    "communication",
    "recompute_working",
    "fragmentation_margin",
    "total",
)


@pytest.fixture(scope="module")
def llama70b_plan():
    return build_plan(load_config(["cfg=configs/llama70b_128k.yaml"]))


@pytest.fixture(scope="module")
def llama70b_zero1_plan():
    return build_plan(load_config(["cfg=configs/llama70b_128k.yaml", "parallel.zero_stage=1"]))


@pytest.fixture(scope="module")
def llama8b_plan():
    return build_plan(load_config(["cfg=configs/llama8b_32k.yaml"]))


def test_llama70b_under_zero1_does_not_fit_because_of_full_weights_and_gradients(
    llama70b_zero1_plan,
):
    text, fits, reason = verdict(llama70b_zero1_plan)
    assert not fits and llama70b_zero1_plan.zero_stage == 1
    # bf16 weights (141 GB) and their fp32 gradient (282 GB), whole on every GPU
    assert "gradients (282.2 GB)" in reason and "weights and gradients (423 GB)" in reason, reason
    assert "parameter sharding (parallel.zero_stage=3)" in text, text
    assert llama70b_zero1_plan.configured.trace.quadratic_saved == []


def test_a_job_whose_offload_overflows_host_memory_is_refused_naming_host_memory():
    """At 1M tokens the chosen rung fits the GPU (41 GB of 80) by offloading: what does not
    fit is the nodes' host memory, and the verdict says so with its figures and keys."""
    plan = build_plan(load_config(["cfg=configs/llama70b_128k.yaml", "data.seq_len=1048576"]))
    text, fits, reason = verdict(plan)
    assert not fits and plan.configured.total <= plan.gpu_bytes
    assert reason.startswith(
        "the job does not fit its nodes' host memory: needs 1,568 GB of host memory per node"
    ), reason
    verdict_text = text[text.index("verdict:") :]
    for part in (
        "the node has 410 GB for offload (80% of cluster.host_memory_gb=512)",
        "the biggest term is offloaded activations (1,426 GB)",
        "set cluster.host_memory_gb to the nodes' memory if they have more",
        "compile.offload_activations=false or parallel.offload_optimizer=false",
    ):
        assert part in verdict_text and part in reason, verdict_text
    assert "per GPU" not in verdict_text, verdict_text


def test_llama70b_128k_fits_under_zero3_chosen_by_the_plan(llama70b_plan):
    assert llama70b_plan.zero_stage == 3 and llama70b_plan.fits
    assert llama70b_plan.configured.spec in AUTO_CANDIDATES
    assert llama70b_plan.configured.trace.quadratic_saved == []
    text = render(llama70b_plan)
    assert "ZeRO-3 (FSDP2; chosen: does not fit under ZeRO-1)" in text, text
    assert f"checkpointing {llama70b_plan.configured.label}, chosen by auto" in text, text


def test_plan_command_exits_0_for_llama70b_128k():
    proc = run_command(plan_main, f"cfg={REPO / 'configs' / 'llama70b_128k.yaml'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: fits" in proc.stdout and "under ZeRO-3" in proc.stdout, proc.stdout


def test_plan_refuses_a_job_that_does_not_fit_with_submits_exit_status():
    args = [f"cfg={REPO / 'configs' / 'llama70b_128k.yaml'}", "parallel.zero_stage=1"]
    proc = run_command(plan_main, *args)
    assert proc.returncode == REFUSED == 2, proc.stdout + proc.stderr
    assert "verdict: does not fit" in proc.stdout, proc.stdout
    with pytest.raises(ConfigError) as refused:  # what submit reports with exit status 2
        admit(load_config(args)).refuse_unless_fits()
    assert proc.stderr.splitlines()[0] == f"error: {str(refused.value).splitlines()[0]}"


def test_what_the_traced_graph_cannot_see_is_named_not_a_flat_margin(llama8b_plan):
    """Llama-8B at SP=8: 4 query heads and 1 key/value head a rank after the all-to-all, so
    flash's backward expands dk and dv to the 4 query heads; its dq accumulator is fp32."""
    memory = llama8b_plan.configured
    tokens = memory.trace.tokens
    assert not memory.rung.tiled
    # fp32 dq, and bf16 dk and dv at the query heads' width
    assert memory.terms["attention_backward"] == (4 + 2 * 2) * 4096 * tokens
    assert memory.terms["cublas_workspace"] == 64 * 2**20
    assert memory.outside == {"cuda_context": 0.6e9, "nccl_buffers": 2**28}  # SP spans the world
    assert memory.margin == pytest.approx(0.05 * memory.subtotal)
    assert memory.total == pytest.approx(memory.subtotal * 1.05 + 0.6e9 + 2**28)
    text = render(llama8b_plan)
    for name in ("attention_backward", "cuda_context", "nccl_buffers", "fragmentation_margin"):
        assert name in text


def test_equal_query_and_key_value_heads_need_no_expanded_gradients_and_cpu_ranks_no_runtime():
    mha = load_config(["cfg=configs/llama8b_32k.yaml", "model.num_key_value_heads=32"])
    assert attention_backward_per_token(mha) == 4 * 4096
    two_nodes = load_config(["cfg=configs/llama8b_32k.yaml", "cluster.nodes=2"])
    assert communicators(two_nodes) == 3  # the world's, an SP group's and a DP group's
    cpu = load_config(["cfg=configs/tiny_cpu.yaml"])
    assert outside_allocator(cpu, 1) == ({}, "")


@pytest.mark.parametrize("plan_fixture", ["llama70b_plan", "llama8b_plan"])
def test_auto_picks_the_first_fitting_rung_least_recomputation_first(request, plan_fixture):
    plan = request.getfixturevalue(plan_fixture)
    memories = plan.memories[plan.zero_stage]
    rungs = ladder(plan.cfg)
    chosen = rungs.index(plan.configured.rung)
    assert memories[rungs[chosen]].fits(plan.gpu_bytes)
    assert not any(memories[rung].fits(plan.gpu_bytes) for rung in rungs[:chosen])
    flops = [memories[Rung(spec)].trace.recompute_flops for spec in AUTO_CANDIDATES]
    assert flops == sorted(flops), flops


def test_plan_tile_is_the_largest_power_of_two_within_256_mib_of_mlp_intermediate():
    cfg = load_config(["cfg=configs/llama8b_32k.yaml"])
    assert tile_tokens_for(cfg.compile, 14336, 2, 524288) == 8192  # 8,192 x 14,336 x 2 B = 224 MiB
    assert tile_tokens_for(cfg.compile, 14336, 2, 1000) == 1000
    cfg.compile.tile_tokens = 512
    assert tile_tokens_for(cfg.compile, 14336, 2, 524288) == 512


def test_ladder_ends_with_tiling_then_offloads_of_the_least_memory_policies():
    rungs = ladder(load_config(["cfg=configs/llama8b_32k.yaml"]))
    assert [r.spec for r in rungs[: len(AUTO_CANDIDATES)]] == list(AUTO_CANDIDATES)
    tail = [
        (spec_label(r.spec), r.tiled, r.offload, r.offload_optimizer)
        for r in rungs[len(AUTO_CANDIDATES) :]
    ]
    assert tail == [
        ("sac (budget 0, all-to-all recomputed)", True, False, False),
        ("full (all-to-all recomputed)", True, False, False),
        ("sac (budget 0, all-to-all recomputed)", True, True, False),
        ("full (all-to-all recomputed)", True, True, False),
        ("sac (budget 0, all-to-all recomputed)", True, False, True),
        ("full (all-to-all recomputed)", True, False, True),
        ("sac (budget 0, all-to-all recomputed)", True, True, True),
        ("full (all-to-all recomputed)", True, True, True),
    ]
    fixed = ladder(
        load_config(
            [
                "cfg=configs/llama8b_32k.yaml",
                "compile.tile_tokens=0",
                "compile.offload_activations=false",
                "parallel.offload_optimizer=false",
            ]
        )
    )
    assert [r.spec for r in fixed] == list(AUTO_CANDIDATES) and not any(
        r.tiled or r.offload or r.offload_optimizer for r in fixed
    )


def test_tiling_and_offload_extend_the_longest_sequence_llama8b(llama8b_plan):
    """Each rung down the ladder trains a longer sequence than the untiled, resident rung."""
    memories = llama8b_plan.memories[3]
    full_a2a = ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True)
    untiled, tiled = memories[Rung(full_a2a)], memories[Rung(full_a2a, tiled=True)]
    offloaded = memories[Rung(full_a2a, tiled=True, offload=True)]
    assert (
        tiled.trace.tiled and tiled.tile_tokens == 4096
    )  # the local sequence, 32,768 / 8: shorter than a tile
    assert llama8b_plan.longest_seq(offloaded) > llama8b_plan.longest_seq(untiled)
    # on the GPU: the layer being written out or in use, and the one fetched ahead
    t = offloaded.trace
    assert offloaded.terms["activations"] == pytest.approx(2 * t.activation_bytes + t.shared_bytes)
    assert offloaded.host_bytes == pytest.approx(
        32 * t.activation_bytes
        + offloaded.terms["logits_and_loss"] * 0
        + t.tokens * (4096 * 4 + 4 + 4096 * 2 + 8)
        + SLAB_BYTES  # one slab of the offload's host arena
    )
    assert offloaded.host_bytes > 0 and untiled.host_bytes == 0


def test_llama8b_4m_fits_one_node_with_tiled_offloaded_layers():
    """The issue's goal: 4M tokens of Llama-3.1-8B on one node of 8 x 80 GB (2 TB of host
    memory). Each tiled layer keeps only its input (8 KiB per token, to host memory), and no
    all-to-all spans the sequence (chunked by tile)."""
    plan = build_plan(load_config(["cfg=configs/llama8b_4m.yaml"]))
    text, fits, _ = verdict(plan)
    memory = plan.configured
    assert fits and plan.zero_stage == 3, text
    assert memory.label == "full (all-to-all recomputed) + tiled layers + offload", memory.label
    assert memory.tile_tokens == 8192 and memory.trace.largest_all_to_all_bytes == 0
    assert memory.trace.activation_bytes == memory.trace.tokens * 4096 * 2
    assert plan.longest_seq(memory) >= 4 * 2**20
    assert memory.host_bytes * 8 <= 2048e9 * 0.8


LLAMA8B_32M_8_NODES = [
    "cfg=configs/llama8b_32m.yaml",
    "cluster.nodes=8",
    "parallel.sp_size=64",
    "cluster.signal_delay_s=65535",
]


@pytest.fixture(scope="module")
def hybrid_plan():
    """Llama-3.1-8B at 32M tokens on 8 nodes of 8 x 80 GB: SP=64 past its 32 heads."""
    return build_plan(load_config(LLAMA8B_32M_8_NODES))


def test_llama8b_32m_fits_16_nodes_as_ulysses8_times_ring16():
    """SP past the head count: Ulysses 8 inside each node, ring 16 across them; the layer is
    traced at the Ulysses size, and the ring's blocks in flight are a term of their own."""
    plan = build_plan(load_config(["cfg=configs/llama8b_32m.yaml"]))
    text, fits, _ = verdict(plan)
    memory = plan.configured
    assert fits and plan.zero_stage == 3, text
    assert memory.label == "full (all-to-all recomputed) + tiled layers + offload"
    assert (memory.trace.sp_size, memory.trace.ring_size, memory.trace.local_seq) == (8, 16, 2**18)
    # a K block: 8 ranks' tokens of one (repeated) KV head of 128, bf16: 2 KiB per local token;
    # K and V of three blocks in bf16 and of four in fp32; the queries' 32 heads of 128 (8 KiB
    # in bf16 per local token): queries, output and its gradient in bf16, dq in fp32
    assert ring_blocks_per_token(plan.cfg, 8, 16) == 2 * (3 * 2048 + 4 * 4096) + 3 * 8192 + 16384
    assert memory.terms["ring_kv_blocks"] == 86016 * 2**18
    # tiled layers keep the ring's output (bf16, 32 heads of 128) and log-sum-exp (fp32) per
    # token beside the layer's input: backward never runs the ring again
    assert memory.trace.recomputed_attention == 0
    assert memory.trace.activation_bytes == (4096 * 2 + 4096 * 2 + 32 * 4) * 2**18
    assert memory.total < 80e9 and plan.longest_seq(memory) >= 2**25
    rendered = render(plan)
    assert "SP=128 = Ulysses 8 x ring 16 (262144 tokens per rank)" in rendered
    assert (
        "ring attention: SP 128 = Ulysses 8 x ring 16: Ulysses groups inside NVLink domains (the "
        "first on node 0), ring over nodes 0-15 (16 NVLink domains); per layer each rank sends "
        "16.11 GB of K/V forward and 48.32 GB of K/V and dK/dV backward = 1,288 ms at 50 GB/s "
        "between domains, hidden behind"
    ) in rendered


def test_past_the_head_count_the_ring_grows_the_longest_sequence_with_the_gpus(hybrid_plan):
    """Ulysses alone stops at the 32 heads (SP=32 across nodes, here DP=2 on 64 GPUs): the ring
    takes SP to 64 on those GPUs (1.16x: the ring keeps its outputs and holds its blocks' and
    queries' copies) and to 128 on 16 nodes."""
    ulysses_only = build_plan(
        load_config(
            [
                *LLAMA8B_32M_8_NODES,
                "parallel.sp_size=32",
                "parallel.ring_size=1",
                "parallel.allow_cross_domain=true",
            ]
        )
    )
    sixteen_nodes = build_plan(load_config(["cfg=configs/llama8b_32m.yaml"]))
    rung = hybrid_plan.configured.rung
    alone = ulysses_only.longest_seq(ulysses_only.memories[3][rung])
    hybrid = hybrid_plan.longest_seq(hybrid_plan.memories[3][rung])
    wider = sixteen_nodes.longest_seq(sixteen_nodes.memories[3][rung])
    assert 1.15 < hybrid / alone < 1.25, (hybrid, alone)
    assert 2.3 < wider / alone < 2.5, (wider, alone)


def test_ring_terms_follow_the_ulysses_group(hybrid_plan):
    cfg = hybrid_plan.cfg
    # 4 query heads and one repeated KV head a rank: dk and dv expanded, as at SP=8
    assert attention_backward_per_token(cfg) == 4 * 4096 + 2 * 2 * 4096
    assert communicators(cfg) == 3  # the world (= the SP group), the Ulysses and ring groups


def test_a_ring_counts_attention_flops_once_per_block_it_meets():
    spec = ActivationCheckpointSpec(ActivationCheckpointing.none)
    model = load_config([]).model  # tiny Llama: 4 heads of 16, 2 KV heads
    (alone,) = trace_decoder_layer(
        model, local_seq=64, sp_size=2, specs=[spec], dtype=torch.float32
    )
    (ring,) = trace_decoder_layer(
        model, local_seq=64, sp_size=2, specs=[spec], dtype=torch.float32, ring_size=4
    )
    causal = 4 * 1 * 2 * 128 * 128 * 16 // 2  # 4 B H S S D / 2: 2 heads a rank, 128 tokens
    assert ring.forward_flops - alone.forward_flops == 3 * causal
    assert ring.activation_bytes == alone.activation_bytes  # memory: one block, as traced


def test_a_job_too_long_for_ulysses_is_offered_sp_past_the_heads():
    """16M tokens on 8 nodes: one node's SP=8 cannot hold them, Ulysses 8 x ring 8 can."""
    plan = build_plan(
        load_config([*LLAMA8B_32M_8_NODES, "parallel.sp_size=8", f"data.seq_len={2**24}"])
    )
    text, fits, _ = verdict(plan)
    assert not fits
    assert (
        "parallel.sp_size=64 (Ulysses 8 x ring 8) with full (all-to-all recomputed) + tiled "
        "layers + offload" in text
    ), text


def test_a_tiled_layers_tiles_run_beside_less_than_its_full_width_peak():
    """A tiled layer's tiles run between its full-width points (attention's backward), beside
    only what lives between them: its working set is the larger of the two, not their sum, and
    the longest sequence fits under both (the tile branch binds at short sequences, the
    full-width one at long)."""
    plan = build_plan(load_config(["cfg=configs/llama8b_4m.yaml"]))
    full_a2a = ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True)
    memory = plan.memories[3][Rung(full_a2a, tiled=True)]
    t, tile = memory.trace, memory.tile_tokens
    beside = t.tile_alongside_bytes + tile * t.tile_bytes_per_token
    assert 0 < t.tile_alongside_bytes < t.working_bytes
    assert memory.terms["recompute_working"] == max(t.working_bytes, beside)
    local = memory.longest_local_seq(plan.gpu_bytes)
    assert memory.total_at(local) <= plan.gpu_bytes < memory.total_at(local + 1)
    short = tile  # one tile's worth of tokens: the tile branch is the larger there
    per_token = t.working_bytes / t.tokens
    assert memory.excess_at(short) == pytest.approx(
        t.tile_alongside_bytes / t.tokens * short
        + tile * t.tile_bytes_per_token
        - per_token * short
    )
    assert memory.excess_at(10 * t.tokens) == 0.0


def test_tiled_layers_reach_1m_tokens_for_llama70b_on_8_nodes():
    """With 2 TB of host memory per node, 70B's limit is the host memory the offload fills."""
    plan = build_plan(
        load_config(["cfg=configs/llama70b_128k.yaml", "cluster.host_memory_gb=2048"])
    )
    full_a2a = ActivationCheckpointSpec(ActivationCheckpointing.full, recompute_all_to_all=True)
    offloaded = plan.memories[3][Rung(full_a2a, tiled=True, offload=True)]
    assert plan.longest_seq(offloaded) >= 2**20
    local = plan.longest_seq(offloaded) // 8
    assert local * offloaded.host_per_token <= offloaded.host_bytes_per_rank


def test_zero3_terms_are_fsdp2_fp32_shards_plus_gathered_bf16_layers(llama70b_plan):
    """Sharded fp32 parameters, fp32 gradients and Adam m, v: 16 bytes per parameter over the
    world. Gathered: bf16 root group (embedding, lm_head, final norm) and two layers, the
    lm_head's bf16 gradient, one layer's bf16 gradient and its fp32 copy."""
    m = load_config(["cfg=configs/llama70b_128k.yaml"]).model
    world = 64
    head_dim = m.hidden_size // m.num_attention_heads
    layer = (
        2 * m.hidden_size * m.num_attention_heads * head_dim
        + 2 * m.hidden_size * m.num_key_value_heads * head_dim
        + 3 * m.hidden_size * m.intermediate_size
        + 2 * m.hidden_size
    )
    head = m.vocab_size * m.hidden_size
    root = 2 * head + m.hidden_size
    params = layer * m.num_hidden_layers + root
    assert llama70b_plan.parameters == params
    zero3, zero1 = (
        llama70b_plan.configured.terms,
        llama70b_plan.memories[1][llama70b_plan.configured.rung].terms,
    )
    assert zero3["parameters"] == zero3["gradients"] == 4 * params / world
    assert zero3["optimizer_shard"] == 8 * params / world
    assert zero3["parameters"] + zero3["gradients"] + zero3["optimizer_shard"] == pytest.approx(
        16 * params / world
    )
    assert zero3["gathered_weights"] == 2 * (root + 2 * layer + head) + (2 + 4) * layer
    assert zero1["communication"] == zero3["communication"]  # the all-to-all's alone
    # ZeRO-1 in bf16: each bf16 gradient and its fp32 copy, at most the 128k x 8192 embedding's
    assert zero1["gradient_conversion"] == (2 + 4) * head
    assert "gradient_conversion" not in zero3 and "reduce_bucket" not in zero3
    assert "gathered_weights" not in zero1


def test_an_moe_counts_every_expert_of_every_layer_and_gathers_its_largest_layer():
    """DeepSeek-V3's first layer is dense, the others hold every routed expert: the plan's
    parameters are the model's, and the layer FSDP2 gathers is an MoE one."""
    cfg = load_config(
        [
            "cfg=configs/tiny_cpu.yaml",
            "model.model_type=deepseek_v3",
            "model.num_hidden_layers=3",
            "model.extra.first_k_dense_replace=1",
            "model.extra.n_routed_experts=8",
            "model.extra.n_group=1",
            "model.extra.topk_group=1",
        ]
    )
    skeleton = build_skeleton(cfg.model)
    size = model_size(cfg.model)
    assert size.total == sum(p.numel() for p in skeleton.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in skeleton.model.layers]
    assert size.layer == max(layers) == layers[1] > layers[0]


def test_plan_prints_every_term_and_the_longest_sequence_per_policy(llama70b_plan):
    text = render(llama70b_plan)
    for term in (*TERMS, "gathered_weights"):
        assert term in text, term
    for policy in (
        "none",
        "torch_default",
        "full",
        "full (all-to-all recomputed)",
        "sac (budget 0)",
    ):
        assert f"  {policy} " in text, policy


def test_masked_documents_count_every_micro_batchs_document_boundaries(llama8b_plan, tmp_path):
    """cu_seqlens, int32, at most a document per token of the whole sequence (SP=8) plus the
    total, for each of the 4 micro-batches a step prepares; plain rows carry none."""
    masked = load_config(
        [
            "cfg=configs/llama8b_32k.yaml",
            "data.source=tokens",
            f"data.path={tmp_path}",
            "data.documents=masked",
        ]
    )
    plain = llama8b_plan.configured
    memory = policy_memory(
        masked, plain.trace, model_size(masked.model), llama8b_plan.zero_stage, plain.rung
    )
    tokens = plain.trace.tokens
    assert memory.terms["document_boundaries"] == 4 * (4 * 8 * tokens + 4)
    assert memory.per_token - plain.per_token == 4 * 4 * 8
    assert memory.fixed == pytest.approx(plain.fixed + 4 * 4)
    assert "document_boundaries" not in plain.terms


def test_llama8b_32k_fits_with_sac_under_zero1(llama8b_plan):
    text, fits, reason = verdict(llama8b_plan)
    assert fits and "verdict: fits" in text and reason == "", text
    assert (
        llama8b_plan.zero_stage == 1
        and llama8b_plan.configured.spec.policy is ActivationCheckpointing.sac
    )


def test_cpu_jobs_always_fit_without_tracing():
    planned = plan_verdict(load_config(["cfg=configs/tiny_cpu.yaml"]))
    assert planned.fits and "CPU" in planned.text and planned.choices.zero_stage == 1


def test_without_a_plan_auto_and_the_stage_resolve_without_tracing():
    cpu = load_config(["cfg=configs/tiny_cpu.yaml", "parallel.zero_stage=null"])
    assert activation_checkpoint_spec_for(cpu) == ActivationCheckpointSpec(
        ActivationCheckpointing.sac, budget=1.0
    )
    assert zero_stage_for(cpu) == 1
    builder = load_config(["cluster.gpus_per_node=8", "model.builder=pkg.mod:fn"])
    assert activation_checkpoint_spec_for(builder) == ActivationCheckpointSpec(
        ActivationCheckpointing.sac, budget=0.0
    )
    assert zero_stage_for(builder) == 1
    assert zero_stage_for(load_config(["cluster.gpus_per_node=8", "parallel.zero_stage=3"])) == 3


# ----------------------------------------------------------------------------- measured on CPU

SEQS = (2048, 4096)
BUDGETS = (0.0, 1.0)


def _forward_rss(seqs, budgets, queue):
    """In a fresh process (SP=1, one gloo rank): VmRSS after minus before the forward of the
    second step at each length, the model compiled per layer with SAC at each budget in turn
    (one process for both: the imports and process group are paid once), with dynamic shapes
    from the first length on (one compile serves both lengths)."""
    import torch.distributed as dist

    from slurm_autosp.compile import AutoSPBackend, compile_model
    from slurm_autosp.compile.activation_checkpointing import ActivationCheckpointSpec
    from slurm_autosp.model import build_model
    from slurm_autosp.sp import prepare_sp_inputs, set_sp_group
    from slurm_autosp.sp.chunked_loss import causal_lm_loss

    torch.set_num_threads(1)
    torch._dynamo.config.assume_static_by_default = False
    dist.init_process_group(
        "gloo", init_method=f"file://{os.environ['PLAN_TEST_STORE']}", rank=0, world_size=1
    )
    set_sp_group(dist.group.WORLD)
    cfg = load_config(["model.num_hidden_layers=4"])

    def rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    measured = {}
    for budget in budgets:
        torch.compiler.reset()
        model = build_model(cfg.model)
        compile_model(
            model, AutoSPBackend(1, ActivationCheckpointSpec("sac", budget=budget)), per_layer=True
        )
        for seq in seqs:
            batch = prepare_sp_inputs(torch.randint(1, 256, (1, seq)), sp_rank=0, sp_size=1)
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                before = rss()
                loss = causal_lm_loss(model, batch.model_kwargs(seq - 1), chunk_tokens=256)
                measured[budget, seq] = rss() - before
                loss.backward()
        del model, loss
    dist.destroy_process_group()
    queue.put(measured)


@pytest.fixture(scope="module")
def measured_forward_rss(tmp_path_factory, compile_cache_dir):
    """{(budget, seq): bytes} the forward added to the resident set, measured once."""
    tmp_path = tmp_path_factory.mktemp("forward_rss")
    context = mp.get_context("spawn")
    queue = context.Queue()
    env = {
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PLAN_TEST_STORE": str(tmp_path / "store"),
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        process = context.Process(target=_forward_rss, args=(SEQS, BUDGETS, queue))
        process.start()
        measured = queue.get(timeout=900)
        process.join(60)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return measured


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_predicted_activation_memory_is_within_15_percent_of_measured_on_cpu(
    measured_forward_rss, budget
):
    """Measured: the resident set grows by what the forward keeps for backward (glibc returns
    freed blocks of 64 KiB or more at once with MALLOC_MMAP_THRESHOLD_). Predicted: the plan's
    activations and final-norm/loss inputs, from the partitioned joint graph of one layer."""
    from slurm_autosp.memory_plan.layer_graph import trace_decoder_layer

    cfg = load_config(["model.num_hidden_layers=4"])
    hidden, layers = cfg.model.hidden_size, cfg.model.num_hidden_layers
    for seq in SEQS:
        (trace,) = trace_decoder_layer(
            cfg.model,
            local_seq=seq,
            sp_size=1,
            dtype=torch.float32,
            specs=[ActivationCheckpointSpec("sac", budget=budget)],
        )
        final_norm_and_loss = hidden * 4 + 4 + hidden * 4 + 8 + 8
        predicted = layers * trace.activation_bytes + trace.shared_bytes + final_norm_and_loss * seq
        measured = measured_forward_rss[budget, seq]
        error = (predicted - measured) / measured
        print(
            f"budget {budget} seq {seq}: predicted {predicted / 2**20:.2f} MiB, "
            f"measured {measured / 2**20:.2f} MiB ({error:+.1%})"
        )
        assert abs(error) <= 0.15, (
            f"seq {seq}: predicted {predicted} B, measured {measured} B ({error:+.1%})"
        )


MOE = [
    "cfg=configs/llama8b_32k.yaml",
    "model.model_type=mixtral",
    "model.hidden_size=1024",
    "model.intermediate_size=2048",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=2",
    "model.extra.num_local_experts=8",
    "model.extra.output_router_logits=true",
]


def test_an_moe_layer_is_traced_whole_its_saved_activations_growing_with_the_active_experts():
    """The experts run as one grouped matmul over the tokens' top-k choices (shapes free of the
    routing), so the layer traces as one graph on fake tensors; what it saves grows with top_k,
    not with the experts a token skips."""
    spec = [ActivationCheckpointSpec(ActivationCheckpointing.none)]
    saved = {}
    for top_k in (1, 2):
        cfg = load_config([*MOE, f"model.extra.num_experts_per_tok={top_k}"])
        (trace,) = trace_decoder_layer(cfg.model, local_seq=1024, sp_size=8, specs=spec)
        saved[top_k] = sum(t.nbytes for t in trace.saved if t.kind == "activation")
    assert saved[2] > saved[1] > 0, saved


def test_the_plan_of_an_moe_job_prints_a_verdict():
    proc = run_command(plan_main, *[a.replace("cfg=", f"cfg={REPO}/", 1) for a in MOE])
    assert proc.returncode in (0, REFUSED), proc.stdout + proc.stderr
    assert "verdict:" in proc.stdout and "Traceback" not in proc.stderr


def test_memory_outside_the_allocator_a_job_measured_replaces_the_estimate(tmp_path):
    """After its first step a GPU job records its busiest rank's device memory outside torch's
    allocator (the CUDA context, NCCL's buffers as NCCL sized them); the run's next plan
    counts that, for the layout it was measured at only."""
    keys = ["cfg=configs/llama8b_32k.yaml", f"run.output_root={tmp_path}"]
    cfg = load_config(keys)
    path = RunDir(cfg.run.dir).outside_allocator
    path.parent.mkdir(parents=True)
    estimated, source = outside_allocator(cfg, 1)
    assert estimated == {"cuda_context": 0.6e9, "nccl_buffers": 2**28}
    assert source == "estimated until a job of this layout measures it"

    record = OutsideAllocator(3.1e9, 8, 8, 1, 1, "NVIDIA H100 80GB HBM3", 1)
    record.write(path)
    assert OutsideAllocator.read(path) == record
    plan = build_plan(cfg)
    memory = plan.configured
    assert memory.outside == {"outside_allocator": 3.1e9}
    assert memory.total == pytest.approx(memory.subtotal * 1.05 + 3.1e9)
    assert f"measured on NVIDIA H100 80GB HBM3 after step 1, the busiest rank: {path}" in render(
        plan
    )

    two_nodes, source = outside_allocator(load_config([*keys, "cluster.nodes=2"]), 1)
    assert two_nodes == {"cuda_context": 0.6e9, "nccl_buffers": 3 * 2**28}
    assert "holds another layout's (world 8, SP 8, ring 1, ZeRO-1)" in source, source
    fsdp2, _ = outside_allocator(cfg, 3)  # DeepSpeed builds communicators FSDP2 does not
    assert fsdp2 == estimated

    probe = RunDir(cfg.run.dir).probe_run.outside_allocator  # the run's own comes first
    probe.parent.mkdir(parents=True)
    OutsideAllocator(2.5e9, 8, 8, 1, 1, "NVIDIA H100 80GB HBM3", 1).write(probe)
    assert outside_allocator(cfg, 1)[0] == {"outside_allocator": 3.1e9}
    path.unlink()
    assert outside_allocator(cfg, 1)[0] == {"outside_allocator": 2.5e9}
    probe.unlink()

    path.write_text('{"bytes": -1}')
    with pytest.raises(ConfigError, match="not a record of memory outside torch's allocator"):
        outside_allocator(cfg, 1)


def test_zero1_counts_the_gradients_way_into_deepspeed_as_each_of_its_optimizers_takes_it():
    """bf16 without optimizer offload runs BF16_Optimizer: no bucket, the reduction in place on
    its flat fp32 gradient, but each bf16 gradient's fp32 copy as it is added in (6 bytes a
    parameter of the largest tensor); fp32, or optimizer offload, runs DeepSpeed's ZeRO
    optimizer and its 5e8-element fp32 reduce bucket, allocated during backward."""
    keys = ["cfg=configs/llama8b_32k.yaml", "parallel.zero_stage=1"]
    bf16 = build_plan(load_config(keys)).configured.terms
    assert bf16["gradient_conversion"] == 6 * 128_256 * 4096 and "reduce_bucket" not in bf16
    offloaded = build_plan(load_config([*keys, "parallel.offload_optimizer=true"])).configured
    assert offloaded.terms["reduce_bucket"] == 5e8 * 4
    assert "gradient_conversion" not in offloaded.terms
    tiny = build_plan(load_config(["cfg=configs/tiny_cpu.yaml", "parallel.zero_stage=1"]))
    assert tiny.configured.terms["reduce_bucket"] == 5e8 * 4  # fp32


def test_offloaded_activations_whose_copies_fall_behind_the_forward_stay_on_the_gpu():
    """Nothing holds the forward back for its copies to host memory: where a layer's copy
    takes longer than its forward, what is not copied yet is still on the GPU, and the plan
    counts it (at 25 GB/s the copies hide; at 10 GB/s they fall behind)."""
    keys = [
        "cfg=configs/llama8b_32k.yaml",
        "compile.offload_activations=true",
        "compile.tile_tokens=0",
    ]
    hidden = build_plan(load_config(keys)).configured
    slow_cfg = load_config([*keys, "cluster.host_link_gb_per_s=10"])
    slow = build_plan(slow_cfg).configured
    trace = slow.trace
    assert offload_lag_layers(load_config(keys), hidden.trace, 32) == 0
    lag = offload_lag_layers(slow_cfg, trace, 32)
    copy = trace.activation_bytes / 10e9
    forward = trace.forward_flops / (989e12 * 0.4)
    assert lag == pytest.approx(32 * (1 - forward / copy)) and 0 < lag < 30
    assert hidden.terms["activations"] == 2 * trace.activation_bytes + trace.shared_bytes
    assert slow.terms["activations"] == pytest.approx(
        (2 + lag) * trace.activation_bytes + trace.shared_bytes
    )
    assert offload_lag_layers(load_config(["cfg=configs/tiny_cpu.yaml"]), trace, 2) == 0


LORA_RANK = 16


def _lora_adapters_per_layer(m) -> int:
    """rank x (in + out) for each of a Llama layer's seven projections."""
    head_dim = m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * head_dim, m.num_key_value_heads * head_dim
    h, i = m.hidden_size, m.intermediate_size
    pairs = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return LORA_RANK * sum(a + b for a, b in pairs)


def test_a_lora_plan_holds_the_frozen_base_without_gradients_or_optimizer_state(llama8b_plan):
    """Llama-8B with rank-16 adapters on all seven projections: every GPU still holds every
    weight (bf16 under ZeRO-1, fp32 shards under ZeRO-3), but only the 42M adapter parameters
    have gradients and Adam's state; the activations are the full fine-tune's."""
    lora = load_config(["cfg=configs/llama8b_32k.yaml", f"model.lora.rank={LORA_RANK}"])
    m, world = lora.model, 8
    full, size = model_size(load_config(["cfg=configs/llama8b_32k.yaml"]).model), model_size(m)
    adapters = _lora_adapters_per_layer(m) * m.num_hidden_layers
    assert size.trained == adapters == 41_943_040
    assert size.total == full.total + adapters and size.frozen == full.total
    assert size.trained_root == size.trained_head == 0
    assert size.trained_layer == _lora_adapters_per_layer(m)
    assert size.trained_largest == LORA_RANK * m.intermediate_size  # gate/up's B, down's A
    plain = llama8b_plan.configured
    memories = {
        stage: (
            policy_memory(lora, plain.trace, size, stage, plain.rung),
            llama8b_plan.memories[stage][plain.rung],
        )
        for stage in (1, 3)
    }
    adapted, whole = memories[1]
    params = size.total
    assert adapted.terms["parameters"] == 2 * params  # the bf16 model, adapters included
    assert adapted.terms["gradients"] == 4 * adapters
    assert adapted.terms["optimizer_shard"] == 12 * adapters / world
    assert adapted.terms["gradient_conversion"] == 6 * LORA_RANK * m.intermediate_size
    # what the full fine-tune holds beyond the frozen base's weights: its gradient and state
    saved = 4 * full.total + 12 * full.total / world - 4 * adapters - 12 * adapters / world
    saved += 6 * 128_256 * 4096 - 6 * LORA_RANK * m.intermediate_size - 2 * adapters
    assert whole.subtotal - adapted.subtotal == pytest.approx(saved)
    assert whole.total - adapted.total == pytest.approx(saved * 1.05)
    assert whole.total - adapted.total > 45e9  # 75.4 -> 26.0 GB
    adapted, whole = memories[3]
    # the adapters' fp32 shards, the frozen base's in bf16
    assert adapted.terms["parameters"] == (4 * adapters + 2 * full.total) / world
    assert adapted.terms["gradients"] == 4 * adapters / world
    assert adapted.terms["optimizer_shard"] == 8 * adapters / world
    # the root and two layers gathered in bf16; no lm_head gradient; one layer's adapters'
    assert adapted.terms["gathered_weights"] == 2 * (size.root + 2 * size.layer) + 6 * (
        size.trained_layer
    )
    assert whole.total - adapted.total > 12e9
    for stage in (1, 3):
        adapted, whole = memories[stage]
        for term in ("activations", "logits_and_loss", "communication", "recompute_working"):
            assert adapted.terms[term] == whole.terms[term], (stage, term)
        assert adapted.per_token == whole.per_token


def test_a_lora_plan_counts_only_the_adapters_in_offloaded_state_and_checkpoints(llama8b_plan):
    """Optimizer offload moves only the adapters' state; a checkpoint holds the adapters (and
    their optimizer shard), never the frozen base."""
    from slurm_autosp.lifecycle.save_time import rank0_checkpoint_bytes
    from slurm_autosp.memory_plan.terms import MemoryPlan, trained_summary

    lora = load_config(["cfg=configs/llama8b_32k.yaml", "model.lora={}"])
    size = model_size(lora.model)
    plain = llama8b_plan.configured
    rung = next(r for r in llama8b_plan.memories[1] if r.offload_optimizer and not r.offload)
    offloaded = policy_memory(lora, plain.trace, size, 1, rung)
    assert offloaded.terms["optimizer_shard"] == 0
    assert offloaded.host_fixed == (12 + 4 + 2) * size.trained / 8
    plan = MemoryPlan(lora, size.total, size.trained, 80e9, 1, plain, {})
    assert rank0_checkpoint_bytes(lora, plan.trained, 1) == 2 * size.trained + 12 * size.trained / 8
    assert trained_summary(plan) == (
        "LoRA rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: 41.9M "
        "of 8.07B parameters trained (the base frozen: no gradients, no optimizer state)"
    )
    assert trained_summary(llama8b_plan) == ""


@pytest.mark.slow
def test_llama8b_256k_lora_fits_one_node_under_zero1_and_says_what_it_trains():
    plan = build_plan(load_config(["cfg=configs/llama8b_256k_lora.yaml"]))
    text, fits, _ = verdict(plan)
    assert fits and plan.zero_stage == 1, text
    assert plan.configured.terms["gradients"] == 4 * plan.trained
    assert "41.9M of 8.07B parameters trained" in text
    assert "41.9M of 8.07B parameters trained" in render(plan)
