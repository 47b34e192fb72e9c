"""Packed documents under sequence parallelism equal each document trained alone on one device:
attention within each document, positions restarting per document, no label across a boundary.

The documents are uneven on purpose: one spans the shard boundary, one is shorter than a shard,
one is a single token, and a shard holds nothing but a document's tail (SP=2, row 1) or middle
(SP=4, row 0)."""

import pytest
import torch
import torch.nn.functional as F
from document_cases import PackedCase, packed_sp_step
from test_sp_equivalence import assert_matches_reference

from slurm_autosp.compat.torch_api import compile_fx
from slurm_autosp.compile.activation_checkpointing import (
    ActivationCheckpointPass,
    ActivationCheckpointSpec,
)
from slurm_autosp.config import ActivationCheckpointing
from slurm_autosp.sp import IGNORE_INDEX, prepare_sp_inputs
from slurm_autosp.sp.document_attention import DocumentAttentionError, document_attention
from slurm_autosp.sp.documents import PackedRowsError

TOLERANCE = 1e-5
ROWS_96 = ((10, 55, 20, 11), (1, 39, 56))  # SP=2: shards of 48; SP=4: of 24
ROWS_95 = ((10, 55, 20, 10), (1, 39, 55))  # padded to 96 under SP=2 and SP=4


def assert_matches_documents_alone(results: list[dict[str, float]]) -> None:
    assert all(r["packed"] for r in results), "packed rows must reach document attention"
    assert_matches_reference(results)


# ------------------------------------------------------------------ inputs (no processes)


def _whole(sp_size: int, **batch) -> dict[str, torch.Tensor]:
    shards = [prepare_sp_inputs(**batch, sp_rank=r, sp_size=sp_size) for r in range(sp_size)]
    assert all(torch.equal(s.cu_seqlens, shards[0].cu_seqlens) for s in shards), (
        "same on every rank"
    )
    return {
        "labels": torch.cat([s.shift_labels for s in shards], dim=1),
        "positions": torch.cat([s.position_ids for s in shards], dim=1),
        "cu_seqlens": shards[0].cu_seqlens,
    }


def test_restarting_position_ids_give_document_lengths_positions_and_no_label_across_a_boundary():
    ids = torch.arange(1, 8).expand(2, 7)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])
    whole = _whole(2, input_ids=ids, position_ids=positions)
    ignored = IGNORE_INDEX
    assert whole["labels"].tolist() == [
        [2, 3, ignored, 5, ignored, 7, ignored, ignored],
        [2, 3, 4, 5, 6, 7, ignored, ignored],
    ]
    assert whole["cu_seqlens"].tolist() == [0, 3, 5, 8, 16], (
        "padding joins each row's last document"
    )
    assert whole["positions"][0, :7].tolist() == positions[0].tolist()


def test_document_ids_give_what_restarting_position_ids_give():
    ids = torch.arange(1, 8).expand(2, 7)
    documents = torch.tensor([[0, 0, 0, 4, 4, 9, 9], [3, 3, 3, 3, 3, 3, 3]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])
    by_ids = _whole(2, input_ids=ids, document_ids=documents)
    by_positions = _whole(2, input_ids=ids, position_ids=positions)
    assert all(torch.equal(by_ids[k], by_positions[k]) for k in by_ids)


def test_rows_of_one_document_keep_the_plain_causal_path():
    shard = prepare_sp_inputs(
        torch.arange(1, 9).unsqueeze(0), document_ids=torch.zeros(1, 8), sp_rank=0, sp_size=2
    )
    assert shard.cu_seqlens is None and "cu_seq_lens_q" not in shard.model_kwargs(7)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"document_ids": torch.tensor([[0, 0, 1, 1, 0, 0]])}, "document_ids decrease along a row"),
        (
            {"position_ids": torch.tensor([[0, 1, 2, 5, 6, 7]])},
            "restart at row 0, token 3 with position 5, not 0",
        ),
        (
            {"position_ids": torch.tensor([[3, 4, 0, 1, 2, 3]])},
            "restart at row 0, token 0 with position 3",
        ),
        (
            {
                "document_ids": torch.tensor([[0, 0, 1, 1, 1, 1]]),
                "position_ids": torch.arange(6)[None],
            },
            "position_ids disagree with document_ids",
        ),
        ({"document_ids": torch.tensor([[0, 1, 2]])}, "one id per token"),
    ],
    ids=["ids_not_contiguous", "restart_not_at_0", "first_not_at_0", "disagreeing", "wrong_shape"],
)
def test_inputs_that_do_not_describe_documents_are_refused_by_name(batch, message):
    with pytest.raises(PackedRowsError, match=message):
        prepare_sp_inputs(torch.arange(1, 7).unsqueeze(0), **batch, sp_rank=0, sp_size=2)


# ------------------------------------------------------------------ the op (no processes)


def _qkv(heads: int = 4, kv_heads: int = 2, seq: int = 20) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(2, heads, seq, 8), (2, kv_heads, seq, 8), (2, kv_heads, seq, 8)]
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def test_document_attention_equals_sdpa_on_each_document_forward_and_backward():
    query, key, value = _qkv()
    cu_seqlens = torch.tensor([0, 5, 6, 20, 33, 40], dtype=torch.int32)  # row 1 starts at 20
    output, _ = document_attention(query, key, value, cu_seqlens, 0.3)
    grad = torch.randn_like(output)
    got = torch.autograd.grad(output, (query, key, value), grad)
    pieces = [(0, 0, 5), (0, 5, 6), (0, 6, 20), (1, 0, 13), (1, 13, 20)]
    loss = 0.0
    for row, start, end in pieces:
        span = (slice(row, row + 1), slice(None), slice(start, end))
        alone = F.scaled_dot_product_attention(
            query[span], key[span], value[span], is_causal=True, scale=0.3, enable_gqa=True
        )
        assert torch.allclose(output[span], alone, atol=1e-12, rtol=0)
        loss = loss + (alone * grad[span]).sum()
    expected = torch.autograd.grad(loss, (query, key, value))
    assert all(torch.allclose(g, e, atol=1e-12, rtol=0) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([0, 5, 30, 40], "crosses the end of row 0"),
        ([0, 5, 20, 33], "must run from 0 to"),
        ([0, 5, 5, 20, 40], "empty"),
    ],
    ids=["crossing_rows", "short", "empty_document"],
)
def test_document_attention_refuses_lengths_that_do_not_partition_the_rows(cu_seqlens, message):
    query, key, value = _qkv()
    with pytest.raises(DocumentAttentionError, match=message):
        document_attention(query, key, value, torch.tensor(cu_seqlens), 0.3)


def test_document_attention_refuses_a_longest_length_the_boundaries_do_not_give():
    """The CUDA kernel trusts max_length (reading the boundaries there would wait for the GPU);
    the CPU kernel, which reads them anyway, checks it."""
    query, key, value = _qkv()
    cu_seqlens = torch.tensor([0, 5, 6, 20, 33, 40], dtype=torch.int32)  # longest: 14 (6...20)
    document_attention(query, key, value, cu_seqlens, 0.3, 0, 14)
    with pytest.raises(DocumentAttentionError, match="max_length=13, but the longest document"):
        document_attention(query, key, value, cu_seqlens, 0.3, 0, 13)


def test_sac_keeps_document_attention_and_never_recomputes_it():
    """Under SAC with no budget the op's outputs are saved (tagged MUST_SAVE): the backward
    reads them, never runs the forward again; gradients equal eager ones."""
    tags = ActivationCheckpointPass(
        ActivationCheckpointSpec(ActivationCheckpointing.sac, budget=0.0)
    )
    cu_seqlens = torch.tensor([0, 7, 20, 31, 40], dtype=torch.int32)

    def layer(query, key, value):
        output, _ = document_attention(query.sin(), key.cos(), value, cu_seqlens, 0.3)
        return (output.tanh() * 2).sum()

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches={"joint_custom_post_pass": tags})

    inputs = _qkv()
    # a cached compile of the same graph would skip the pass, and leave its counts unwritten
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        compiled = torch.compile(layer, backend=backend)(*inputs)
    compiled_grads = torch.autograd.grad(compiled, inputs)
    eager_grads = torch.autograd.grad(layer(*inputs), inputs)
    assert tags.last_counts["attention_kept"] == 1
    assert all(
        torch.allclose(c, e, rtol=1e-10) for c, e in zip(compiled_grads, eager_grads, strict=True)
    )


# ------------------------------------------------------------------ SP against each document alone


# Per-layer graphs (the training default) and one model family keep the compiles few: the four
# cases share each process's backend and, across the pools, inductor's cache.
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        PackedCase(ROWS_96, per_layer=True),
        PackedCase(ROWS_95, convention="document_ids", per_layer=True, ignored_labels=True),
    ],
    ids=["position_ids", "document_ids_seq95"],
)
def test_sp2_packed_rows_match_each_document_alone(pool2, case):
    assert_matches_documents_alone(pool2.run(packed_sp_step, case, 2))


@pytest.mark.slow
def test_sp4_packed_rows_with_repeated_kv_heads_match_each_document_alone(pool4):
    """The SP=4 case: 2 KV heads over 4 ranks, each head going to two (one KV head on every
    rank, and Qwen2's q, k, v biases: test_sp_equivalence's SP=2 qwen2 case)."""
    case = PackedCase(ROWS_95, per_layer=True)
    assert_matches_documents_alone(pool4.run(packed_sp_step, case, 4))


@pytest.mark.slow
def test_sp2_dp2_packed_rows_match_each_document_alone(pool4):
    """Each data-parallel rank gets two rows of seven documents, as the SP=2 cases do, so these
    ranks' graphs are those compiled for them (inductor's cache serves them)."""
    rows = ((20, 30, 40, 6), (50, 1, 45))  # DP rank 1's: its own boundaries
    case = PackedCase(
        ROWS_96 + rows, convention="document_ids", per_layer=True, ignored_labels=True
    )
    assert_matches_documents_alone(pool4.run(packed_sp_step, case, 2))
