"""Ulysses x ring sequence parallelism: ring attention alone equals full causal attention, the
zigzag shards cover the sequence, and a model compiled with ring_size > 1 trains exactly as
one device (loss and every gradient), with ring attention never run again in backward."""

import copy
import math
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from document_cases import PackedCase, packed_sp_step
from ring_cases import ring_op_against_full_attention, ring_reruns_under
from sp_cases import Case, sp_step
from test_packed_documents import ROWS_95, ROWS_96, assert_matches_documents_alone
from test_sp_equivalence import assert_matches_reference
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from train_cases import engine_steps, grad_accum_step

import slurm_autosp.sp.ring_attention as ring_module
from slurm_autosp.compat.torch_api import (
    FakeTensorMode,
    flash_attention_backward,
    flash_attention_forward,
)
from slurm_autosp.compile import AutoSPBackend, rewrite_sdpa_for_sp
from slurm_autosp.compile.activation_checkpointing import node_flops
from slurm_autosp.compile.backend import HeadLayout
from slurm_autosp.sp import IGNORE_INDEX, prepare_sp_inputs, sp_token_positions
from slurm_autosp.sp.document_attention import document_spans
from slurm_autosp.sp.kernel_check import GRADIENT_BOUND, OUTPUT_BOUND
from slurm_autosp.sp.ring_attention import ring_attention
from slurm_autosp.sp.ring_layout import chunk_layout
from slurm_autosp.sp.ring_plan import ring_plan, step_pieces
from slurm_autosp.sp.varlen_kernel import VarlenKernelError, varlen_backward, varlen_forward

TOLERANCE = 1e-5
ALL_TO_ALL = torch.ops.slurm_autosp.sp_all_to_all.default
RING = torch.ops.slurm_autosp.ring_attention.default


# ------------------------------------------------------------------ the op alone


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "one_kv_head"])
@pytest.mark.parametrize("ring", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["r2", "r4"])
def test_ring_attention_forward_and_backward_match_full_causal_attention(ring, kv_heads, request):
    pool = request.getfixturevalue(f"pool{ring}")
    results = pool.run(ring_op_against_full_attention, kv_heads)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    print(f"ring {ring}, {kv_heads} KV heads, worst over ranks: {worst}")
    assert all(error <= TOLERANCE for error in worst.values()), worst


# (chunk, documents' lengths per row (the rest of a row one more), window)
PATTERNS = {
    "documents": (8, [[3, 9, 1], [17]], 0),
    "window_shorter_than_a_chunk": (5, None, 4),
    "window_across_chunks": (5, None, 13),
    "documents_and_window": (8, [[3, 9, 1], [11, 2]], 7),
    "window_slices_within_documents": (72, [[100, 7], [181]], 23),
}


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
@pytest.mark.parametrize("ring", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["r2", "r4"])
def test_ring_attention_within_documents_and_windows_matches_the_masked_attention(
    ring, pattern, request
):
    """Documents spanning chunks and ranks, a document of one token, windows shorter than a
    chunk (blocks skipped), longer than one, and long enough to be cut into query slices;
    two KV heads for four query heads."""
    chunk, lengths, window = pattern
    pool = request.getfixturevalue(f"pool{ring}")
    results = pool.run(ring_op_against_full_attention, 2, chunk, torch.float32, lengths, window)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    print(f"ring {ring}, {pattern}: {worst}")
    assert all(error <= TOLERANCE for error in worst.values()), worst


@pytest.mark.slow
def test_ring_attention_matches_a_pairs_messages_by_order_as_nccl_does(pool4):
    """Packed documents over a ring of 4 where ranks skip different blocks: the backward's
    gradient returns fall between the blocks' exchanges in the same order on every rank, so
    the result holds when a pair's messages are matched by order alone (NCCL ignores tags)."""
    lengths = [[1, 8, 6, 5, 3, 3, 5]] * 2
    results = pool4.run(ring_op_against_full_attention, 2, 4, torch.float32, lengths, 0, True)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    assert all(error <= TOLERANCE for error in worst.values()), worst


def test_ring_attention_in_bf16_stays_within_the_document_kernels_bf16_bounds(pool2):
    """bf16 blocks merged in fp32: errors are bf16 rounding (kernel_check's bounds for one
    kernel), not 0 and not a mistake's size."""
    for result in pool2.run(ring_op_against_full_attention, 2, 8, torch.bfloat16):
        print(f"bf16 ring of 2: {result}")
        assert 1e-4 < result["out"] < OUTPUT_BOUND, result
        assert all(result[g] < GRADIENT_BOUND for g in ("dq", "dk", "dv")), result


def test_ring_attention_fake_follows_a_symbolic_sequence_length():
    traced = make_fx(lambda q, k, v: ring_attention(q, k, v, 0.5, 2), tracing_mode="symbolic")(
        torch.randn(1, 4, 6, 2), torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)
    )
    ring_node = next(n for n in traced.graph.nodes if n.target is RING)
    output, lse = ring_node.meta["val"]
    query = next(n for n in traced.graph.nodes if n.op == "placeholder").meta["val"]
    assert output.shape == query.shape and output.is_contiguous()
    assert lse.shape == query.shape[:3] and lse.dtype == torch.float32


class FlashCalls(TorchDispatchMode):
    """Records the flash varlen calls (then runs them: on fake tensors, their meta kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (flash_attention_forward, flash_attention_backward):
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def test_cuda_kernel_runs_each_round_as_one_flash_varlen_call_on_a_fake_cuda_device():
    """Every round of a ring rank's plan (own block causal, earlier blocks whole, windows as
    flash's (left, right)), on fake CUDA tensors (torch's meta kernels give the shapes; nothing
    runs): one flash varlen call each way with the round's cumulative lengths, maxima flash
    reads no other rule from, rule and scale, no dropout; the output and fp32 log-sum-exp of
    its queries, gradients with the KV heads as they came; fp32 and head dimensions flash does
    not take refused by name. tests/compile/test_flash_contract.py checks their numbers."""
    plan = ring_plan(2, 16, ((0, 0, 5), (0, 5, 32), (1, 0, 32)), 6, True)
    rounds = [r for source in plan.rounds[1] for r in source]
    assert {r.rule for r in rounds} >= {(5, 0)}  # the own block, causal within the window
    with FakeTensorMode(allow_non_fake_inputs=True), FlashCalls() as recorded:
        for round_ in rounds:
            tokens_q = sum(p.q_len for p in round_.pieces)
            tokens_k = sum(p.k_len for p in round_.pieces)
            query = torch.empty(tokens_q, 4, 64, dtype=torch.bfloat16, device="cuda")
            key = torch.empty(tokens_k, 1, 64, dtype=torch.bfloat16, device="cuda")
            output, lse = varlen_forward(query, key, key, round_, 0.125)
            assert output.shape == query.shape and output.dtype == torch.bfloat16
            assert lse.shape == (tokens_q, 4) and lse.dtype == torch.float32
            grads = varlen_backward(
                torch.empty_like(output), query, key, key, output, lse, round_, 0.125
            )
            assert [g.shape for g in grads] == [query.shape, key.shape, key.shape]
        query = torch.empty(8, 4, 64, device="cuda")
        with pytest.raises(VarlenKernelError, match="train.precision=bf16"):
            varlen_forward(query, query, query, rounds[0], 0.125)
        odd = torch.empty(8, 4, 60, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(VarlenKernelError, match="multiples of 8 up to 256, not 60"):
            varlen_forward(odd, odd, odd, rounds[0], 0.125)
    ring_plan.cache_clear()  # its rounds hold fake CUDA copies of their indices now
    calls = recorded.calls
    assert [c[0] for c in calls] == [flash_attention_forward, flash_attention_backward] * len(
        rounds
    )
    for index, round_ in enumerate(rounds):
        left, right = round_.rule
        for at, (_, args, kwargs) in ((3, calls[2 * index]), (6, calls[2 * index + 1])):
            assert kwargs["scale"] == 0.125 and args[at + 4] == 0.0
            assert args[at + 5] is (round_.rule == (-1, 0))
            assert (kwargs["window_size_left"], kwargs["window_size_right"]) == (left, right)
            max_q, max_k = args[at + 2 : at + 4]  # the grid's sizes, and flash's rule's bounds
            assert max_q >= max(round_.max_q, 2) and max_k >= round_.max_k
            assert max_k > max(left, right), "a side reaching max_seqlen_k is dropped"
            assert args[at].shape == args[at + 1].shape == (len(round_.pieces) + 1,)


def test_ring_attention_flops_count_the_whole_sequences_keys_causally():
    """The checkpointing pass's cost of one ring call: causal attention of the local queries
    over ring_size blocks of keys, 4 * B * H * S_local * (R * S_local) * D / 2."""
    batch, heads, local, dim, ring = 1, 4, 6, 2, 4
    traced = make_fx(lambda q, k, v: ring_attention(q, k, v, 0.5, ring), tracing_mode="fake")(
        torch.randn(batch, heads, local, dim),
        torch.randn(1, 1, local, dim),
        torch.randn(1, 1, local, dim),
    )
    ring_node = next(n for n in traced.graph.nodes if n.target is RING)
    assert node_flops(ring_node) == 4 * batch * heads * local * ring * local * dim // 2


# ------------------------------------------------------------------ zigzag shards


def test_zigzag_ring_rank_i_holds_chunks_i_and_2r_minus_1_minus_i_split_over_its_ulysses_ranks():
    seq, ulysses, ring = 32, 2, 2  # 4 chunks of 8
    held = [sp_token_positions(seq, r, ulysses * ring, ring).tolist() for r in range(4)]
    chunk = [list(range(c * 8, c * 8 + 8)) for c in range(4)]
    assert held[0] + held[1] == chunk[0] + chunk[3]  # ring rank 0, Ulysses members 0 and 1
    assert held[2] + held[3] == chunk[1] + chunk[2]
    assert sp_token_positions(seq, 1, 4).tolist() == list(range(8, 16))  # no ring: contiguous


def test_ring_shards_pad_to_a_multiple_of_2_sp_with_ignored_labels_and_global_positions():
    ids = torch.arange(1, 28).unsqueeze(0)  # 27 tokens: padded to 32 = 2 x 2 x 2 x 4
    shards = [prepare_sp_inputs(ids, sp_rank=r, sp_size=4, ring_size=2) for r in range(4)]
    assert [s.input_ids.shape[1] for s in shards] == [8] * 4
    for rank, shard in enumerate(shards):
        positions = sp_token_positions(32, rank, 4, 2)
        assert shard.position_ids[0].tolist() == positions.tolist()
        real = positions < 27
        assert shard.input_ids[0, real].tolist() == (positions[real] + 1).tolist()
        labels = torch.where(positions < 26, positions + 2, IGNORE_INDEX)
        assert shard.shift_labels[0].tolist() == labels.tolist()
    assert sum(s.valid_labels for s in shards) == 26


def test_ring_shards_of_packed_rows_carry_the_global_boundaries_and_restarting_positions():
    """Packed rows under a ring are cut into 2R x 4 chunks (padded to a multiple of 8 x SP),
    dealt out by work: every rank holds as many tokens, all of them once."""
    ids = torch.arange(1, 28).unsqueeze(0)
    documents = torch.tensor([[0] * 6 + [1] * 21])
    whole = prepare_sp_inputs(ids, sp_rank=0, sp_size=1, document_ids=documents)
    assert whole.cu_seqlens.tolist() == [0, 6, 27]
    shards = [
        prepare_sp_inputs(ids, sp_rank=r, sp_size=4, ring_size=2, document_ids=documents)
        for r in range(4)
    ]
    assert [s.input_ids.shape[1] for s in shards] == [8] * 4  # 27 padded to 32
    assert all(s.cu_seqlens.tolist() == [0, 6, 32] for s in shards)  # the padding joins the last
    held = [sp_token_positions(32, r, 4, 2, shards[0].cu_seqlens) for r in range(4)]
    assert sorted(torch.cat(held).tolist()) == list(range(32))
    for shard, positions in zip(shards, held, strict=True):
        real = positions < 27
        assert shard.input_ids[0, real].tolist() == (positions[real] + 1).tolist()
        restarted = torch.where(positions < 6, positions, positions - 6)
        assert shard.position_ids[0].tolist() == restarted.tolist()


def _packed_row(seq: int, seed: int) -> tuple[tuple[int, int, int], ...]:
    """One row of documents of log-normal lengths (median seq / 64)."""
    generator, bounds = torch.Generator().manual_seed(seed), [0]
    while bounds[-1] < seq:
        length = torch.empty(1).log_normal_(mean=math.log(seq / 64), std=1.0, generator=generator)
        bounds.append(min(seq, bounds[-1] + max(1, int(length))))
    return tuple((0, start, end) for start, end in pairwise(bounds))


@pytest.mark.parametrize("ring", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_rows_are_dealt_out_to_within_5_percent_of_the_mean_work(ring, seed):
    """Documents cut the causal triangle the zigzag balances; the deal of 2R x 4 chunks by
    their work evens the ranks' query-key pairs out again (the zigzag is off by up to 94% here:
    bench/ring_bench.py)."""
    seq = 16384
    documents = _packed_row(seq, seed)
    work = ring_plan(ring, seq // ring, documents, 0, True)
    pairs = [work.pairs(rank) for rank in range(ring)]
    assert max(pairs) <= 1.05 * sum(pairs) / ring, pairs


def test_the_boundaries_are_read_once_per_tensor_not_per_layer(monkeypatch):
    """Every layer's ring call gets the same boundaries tensor: read back (on a GPU, a wait) the
    first time only, and again once the tensor is changed in place."""
    reads = []

    def counted(cu_seqlens, batch, seq):
        reads.append(cu_seqlens)
        return document_spans(cu_seqlens, batch, seq)

    monkeypatch.setattr(ring_module, "document_spans", counted)
    cu_seqlens = torch.tensor([0, 6, 16], dtype=torch.int32)
    first = ring_module._documents(cu_seqlens, 1, 16)
    assert ring_module._documents(cu_seqlens, 1, 16) == first == ((0, 0, 6), (0, 6, 16))
    assert len(reads) == 1
    cu_seqlens[1] = 9
    assert ring_module._documents(cu_seqlens, 1, 16) == ((0, 0, 9), (0, 9, 16))
    assert len(reads) == 2


# ------------------------------------------------------------------ the plan


def _allowed_pairs(documents, seq: int, window: int) -> int:
    """Causal (query, key) pairs within a document and the window, counted directly."""
    total = 0
    for _, start, end in documents:
        for q in range(start, end):
            low = start if not window else max(start, q - window + 1)
            total += q - low + 1
    return total


@pytest.mark.parametrize("window", [0, 3, 11, 40])
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_the_plan_computes_every_allowed_pair_once(ring, window):
    """Over the ring's ranks and steps the pieces cover exactly the causal pairs within each
    document and window (the op tests show which: its numbers are the masked attention's)."""
    seq = 2 * ring * 12
    documents = ((0, 0, 1), (0, 1, 30), (0, 30, seq), (1, 0, seq))
    plan = ring_plan(ring, seq // ring, documents, window, True)
    assert sum(plan.pairs(rank) for rank in range(ring)) == _allowed_pairs(documents, seq, window)


def test_a_window_shorter_than_a_chunk_sends_each_rank_only_its_neighbouring_chunks():
    """Ring of 4, chunks of 8, window 4: a rank needs only the blocks holding the chunks just
    before its own, so 6 of the 12 block sends remain (a ring without a window sends all 12);
    a block of documents no query shares is not sent either."""
    one_row = ((0, 0, 64),)
    windowed = ring_plan(4, 16, one_row, 4, False)
    assert [windowed.sources(rank) for rank in range(4)] == [[3], [1, 3], [1, 3], [1]]
    assert sum(len(windowed.destinations(rank)) for rank in range(4)) == 6
    plain = ring_plan(4, 16, one_row, 0, False)
    assert sum(len(plain.destinations(rank)) for rank in range(4)) == 12
    # documents of one chunk each: only own blocks are read
    assert (
        ring_plan(4, 16, tuple((0, c * 8, c * 8 + 8) for c in range(8)), 0, False).sources(2) == []
    )


def test_a_ring_without_documents_runs_one_sequence_per_row_and_block():
    """Rank 1 of 2 (chunks 1 and 2 of 4): its own block causal over each chunk and chunk 2 over
    chunk 1 whole; rank 0's block, whose first chunk all its queries read, as one piece."""
    own = step_pieces(1, 1, chunk_layout(2, 16, None), ((0, 0, 16),), 0)
    assert [(p.q_start, p.q_len, p.k_start, p.k_len, p.rule) for p in own] == [
        (0, 4, 0, 4, (-1, 0)),
        (4, 4, 0, 4, (-1, -1)),
        (4, 4, 4, 4, (-1, 0)),
    ]
    earlier = step_pieces(1, 0, chunk_layout(2, 16, None), ((0, 0, 16),), 0)
    assert [(p.q_start, p.q_len, p.k_start, p.k_len, p.rule) for p in earlier] == [
        (0, 8, 0, 4, (-1, -1))
    ]


# ------------------------------------------------------------------ the backend


def _rewritten_graph(sp_size: int, ring_size: int, heads: int = 4, kv_heads: int = 2):
    """The FX graph of one causal SDPA call after the backend's rewrite (the original runs)."""
    graphs = []

    def backend(gm, example_inputs):
        original = copy.deepcopy(gm)
        rewrite_sdpa_for_sp(gm, sp_size, ring_size)
        graphs.append(gm.graph)
        return original.forward

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    q = torch.randn(1, heads, 8, 4)
    k = torch.randn(1, kv_heads, 8, 4)
    torch.compile(attention, backend=backend, fullgraph=True)(q, k, k)
    return graphs[0]


def test_ring_size_1_keeps_the_ulysses_graph_and_ring_2_puts_ring_attention_in_place_of_sdpa():
    ulysses_only = [n.target for n in _rewritten_graph(4, 1).nodes if n.op == "call_function"]
    assert RING not in ulysses_only and F.scaled_dot_product_attention in ulysses_only
    ring = _rewritten_graph(4, 2)
    targets = [n.target for n in ring.nodes if n.op == "call_function"]
    assert targets.count(RING) == 1 and F.scaled_dot_product_attention not in targets
    all_to_alls = [n.args for n in ring.nodes if n.target is ALL_TO_ALL]
    assert len(all_to_alls) == 4 and all(args[3] == 2 for args in all_to_alls)  # Ulysses of 2
    ring_node = next(n for n in ring.nodes if n.target is RING)
    assert ring_node.args[3:] == (0.5, 2)  # head_dim 4: scale 1/2, over a ring of 2


def test_heads_split_over_the_ulysses_size_only_and_a_refusal_names_ring_size():
    assert HeadLayout(2, 1, 4 // 2).kv_repeat == 2  # 2 query heads: SP=4 runs as 2 x 2
    with pytest.raises(Exception, match=r"parallel.ring_size=2.*8 / 2"):
        _rewritten_graph(8, 2, heads=2, kv_heads=1)


def test_backend_refuses_a_ring_size_that_does_not_divide_sp_size():
    with pytest.raises(ValueError, match="ring_size=3 must divide sp_size=4"):
        AutoSPBackend(4, ring_size=3)


# ------------------------------------------------------------------ whole models, one device's numbers


@pytest.mark.slow
def test_sp2_as_ring_2_trains_like_one_device_and_never_reruns_ring_attention_in_backward(pool2):
    """SP=2 as 1 x 2 (Ulysses x ring), 127 tokens (padded to 128), uneven ignored labels,
    activation checkpointing sac at budget 0: everything but attention recomputed."""
    results = pool2.run(sp_step, Case(seq=127, labels="uneven"), 2, 2)
    assert_matches_reference(results)
    assert all(r["ring_forwards_in_backward"] == 0 for r in results), results
    assert all(r["ring_backwards"] == 2 for r in results), results  # one per layer


@pytest.mark.slow
def test_sp2_as_ring_2_within_packed_documents_and_a_window_matches_each_document_alone(pool2):
    """Mistral's 7-token window within documents spanning the zigzag chunks, one of a single
    token: packed rows reach ring attention, one ring backward per layer."""
    case = PackedCase(ROWS_96, family="mistral", window=7, per_layer=True)
    results = pool2.run(packed_sp_step, case, 2, 2)
    assert_matches_documents_alone(results)
    assert all(r["ring_backwards"] == 2 and r["ring_forwards_in_backward"] == 0 for r in results)


@pytest.mark.slow
def test_ring_2_with_left_padding_and_a_window_across_chunks_matches_single_device(pool2):
    """Left padding (a document no real token attends to) under Mistral's 12-token window over
    95 tokens, uneven ignored labels."""
    case = Case(
        family="mistral", window=12, seq=95, left_padding=True, labels="uneven", per_layer=True
    )
    results = pool2.run(sp_step, case, 2, 2)
    assert_matches_reference(results)
    assert all(r["ring_backwards"] == 2 for r in results), results


@pytest.mark.slow
@pytest.mark.parametrize("ring", [2, 4], ids=["2x2", "1x4"])
def test_sp4_ring_within_packed_documents_and_some_windowed_layers_matches(pool4, ring):
    """Qwen2's window on layer 1 only, one KV head, 95 tokens padded to 96."""
    case = PackedCase(ROWS_95, family="qwen2", window=12, kv_heads=1, per_layer=True)
    results = pool4.run(packed_sp_step, case, 4, ring)
    assert_matches_documents_alone(results)
    assert all(r["ring_backwards"] == 2 for r in results), results


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "none"])
def test_ring_attention_is_never_run_again_in_backward_under_any_policy(pool2, policy):
    """Under `full` too (which recomputes SDPA): re-running the ring would send every block
    around it again. (sac is the fast tier's whole-model case.)"""
    for result in pool2.run(ring_reruns_under, policy):
        assert result == {"forwards_in_backward": 0, "backwards": 2}, result


SP4_RING_CASES = {
    "2x2_two_query_heads_one_kv_head": (
        Case(seq=127, labels="uneven", query_heads=2, kv_heads=1),
        2,
    ),
    "1x4_one_kv_head": (Case(seq=127, labels="uneven", kv_heads=1), 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case, ring", SP4_RING_CASES.values(), ids=SP4_RING_CASES.keys())
def test_sp4_with_a_ring_matches_single_device(pool4, case, ring):
    results = pool4.run(sp_step, case, 4, ring)
    assert_matches_reference(results)
    assert all(r["ring_forwards_in_backward"] == 0 for r in results), results


@pytest.mark.slow
def test_ring2_dp2_grad_accum2_equals_one_single_device_batch(pool4):
    result = pool4.run(grad_accum_step, 2, 2, 2)[0]
    print(result)
    assert result["loss_rel_error"] <= TOLERANCE, result
    assert result["grad_rel_error"] <= TOLERANCE, result


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["ring2", "ring2_dp2"])
@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "fsdp2"])
def test_ring2_engine_steps_match_torch_adamw_on_one_device(world, zero_stage, request):
    """Three optimizer steps of two micro-batches through DeepSpeed ZeRO-1 or FSDP2 with SP=2
    as a ring of 2 (x DP=2 on four ranks); under FSDP2 the first step's gathered gradients are
    compared too."""
    pool = request.getfixturevalue(f"pool{world}")
    result = pool.run(engine_steps, zero_stage, 2, 2, 3, 2)[0]
    print(result)
    assert max(result["loss_rel_errors"]) <= TOLERANCE, result
    assert result["param_rel_error"] <= 1e-2, result
    if zero_stage == 3:
        assert result["grad_rel_error"] <= TOLERANCE, result
