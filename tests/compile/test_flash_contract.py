"""What the CUDA flash varlen kernel computes from the arguments our CUDA paths build, where no
GPU is: those exact arguments run through a CPU model of the kernel's contract (its argument
rewriting, its masks aligned at the ends, its log-sum-exp of a row with no key), in float64,
against exact masked attention. The fake-CUDA tests check shapes; these check the numbers."""

import dataclasses
import random

import pytest
import torch
from flash_cases import HEAD_DIM, AttentionCase, document_errors, draw_case, ring_errors
from flash_contract import FlashContract, FlashContractError, KernelRule, kernel_rule

import slurm_autosp.sp.kernel_check as kernel_check
from slurm_autosp.compat.torch_api import flash_varlen_backward, flash_varlen_forward

EXACT = 1e-10


def _assert_exact(errors: dict[str, float], case: object) -> None:
    assert all(error <= EXACT for error in errors.values()), (case, errors)


# ------------------------------------------------------------------ the model's own rules


def test_flash_drops_a_window_side_reaching_max_seqlen_k_and_bounds_it_by_max_seqlen_k():
    """flash_api.cpp then set_params_fprop: (left, right) = (10, 6) under max_seqlen_k = 4 is
    causal with... no: right 6 >= 4 is dropped, left 10 >= 4 too, and neither bound is left."""
    assert kernel_rule(4, 10, 6) == KernelRule(False, False, -1, -1)
    assert kernel_rule(4, 2, 6) == KernelRule(False, True, 2, 4)  # right re-bounded by 4
    assert kernel_rule(4, 9, 0) == KernelRule(True, False, 4, 0)  # causal
    assert kernel_rule(16, 9, 6) == KernelRule(False, True, 9, 6)  # as given


def test_the_model_without_a_rule_to_rewrite_is_exact_attention_forward_and_backward():
    """Two sequences of unequal lengths, grouped KV heads, a window aligned at the ends: the
    model against autograd of masked attention written out here."""
    generator = torch.Generator().manual_seed(0)
    lengths = [(5, 9), (7, 7)]
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 16], dtype=torch.int32)
    query = torch.randn(12, 4, HEAD_DIM, generator=generator, dtype=torch.float64)
    key, value = (
        torch.randn(16, 2, HEAD_DIM, generator=generator, dtype=torch.float64) for _ in "kv"
    )
    grad = torch.randn_like(query)
    sequences = (cu_q, cu_k, 7, 9)
    with FlashContract() as contract:
        output, lse = flash_varlen_forward(query, key, value, sequences, False, (3, 1), 0.5)
        grads = flash_varlen_backward(
            grad, query, key, value, output, lse, sequences, False, (3, 1), 0.5
        )
    assert [call.rule for call in contract.calls] == [KernelRule(False, True, 3, 1)] * 2
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    outputs, lses = [], []
    for (q_len, k_len), q0, k0 in zip(lengths, (0, 5), (0, 9), strict=True):
        q = leaves[0][q0 : q0 + q_len].transpose(0, 1)
        k, v = (t[k0 : k0 + k_len].transpose(0, 1).repeat_interleave(2, 0) for t in leaves[1:])
        aligned = torch.arange(q_len).unsqueeze(1) + k_len - q_len
        j = torch.arange(k_len).unsqueeze(0)
        allowed = (j >= aligned - 3) & (j <= aligned + 1)
        scores = (q @ k.transpose(1, 2) * 0.5).masked_fill(~allowed, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
        lses.append(torch.logsumexp(scores, -1))
    want = torch.cat(outputs)
    want_grads = torch.autograd.grad(want, leaves, grad)
    assert torch.allclose(output, want, atol=EXACT, rtol=0)
    assert torch.allclose(lse, torch.cat(lses, dim=1), atol=EXACT, rtol=0)
    for got, exact in zip(grads, want_grads, strict=True):
        assert torch.allclose(got, exact, atol=EXACT, rtol=0)


def test_a_row_with_no_key_gets_output_0_and_log_sum_exp_plus_infinity():
    """More queries than keys, causal aligned at the ends: the first rows keep no key."""
    query = torch.ones(4, 1, HEAD_DIM, dtype=torch.float64)
    key = value = torch.ones(2, 1, HEAD_DIM, dtype=torch.float64)
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (4, 2))
    with FlashContract():
        output, lse = flash_varlen_forward(
            query, key, value, (cu_q, cu_k, 4, 2), True, (-1, 0), 1.0
        )
    assert output[:2].abs().max() == 0 and torch.isinf(lse[0, :2]).all() and lse[0, 0] > 0
    assert torch.isfinite(lse[0, 2:]).all()


def test_the_model_refuses_the_decoding_branch_it_does_not_reproduce():
    query = torch.zeros(2, 4, HEAD_DIM, dtype=torch.float64)
    key = value = torch.zeros(6, 2, HEAD_DIM, dtype=torch.float64)
    cu_q, cu_k = (
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([0, 3, 6], dtype=torch.int32),
    )
    with FlashContract(), pytest.raises(FlashContractError, match="seqlenq_ngroups_swapped"):
        flash_varlen_forward(query, key, value, (cu_q, cu_k, 1, 3), False, (-1, -1), 1.0)


# ------------------------------------------------------------------ document attention's CUDA path


DOCUMENT_CASES = {
    "packed_rows": AttentionCase(((5, 1, 18), (13, 11)), 24),
    "window_within_documents": AttentionCase(((5, 1, 18), (13, 11)), 24, window=7),
    "window_over_whole_rows": AttentionCase(None, 24, window=7, left_padding=(0, 0)),
    "window_covering_every_document": AttentionCase(((5, 1, 18), (13, 11)), 24, window=30),
    "left_padding_and_a_window": AttentionCase(None, 23, window=5, left_padding=(4, 0)),
    "one_token_documents": AttentionCase(((1,) * 9,), 9),
    "ulysses_4_one_kv_head_each": AttentionCase(((7, 10), (17,)), 17, 4, ulysses=4, heads=(8, 2)),
}


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("case", DOCUMENT_CASES.values(), ids=DOCUMENT_CASES.keys())
def test_document_attentions_cuda_arguments_compute_exact_masked_attention(case, head_major):
    _assert_exact(document_errors(case, head_major=head_major), case)


# ------------------------------------------------------------------ ring attention's CUDA path


# Packed documents under a window on a ring of 2: a round of pieces whose last queries lie
# further past their last keys than the round's longest key run. Flash dropped that right side
# of the window at max_seqlen_k and bounded it by max_seqlen_k: early rows lost keys or kept
# none (log-sum-exp +inf, merged into NaN).
FAR_WINDOW = AttentionCase(((3, 35, 17, 2, 5),), 62, window=32, ring=2, heads=(2, 1))

RING_CASES = {
    "documents_ring_2": AttentionCase(((3, 9, 1, 11), (24,)), 24, ring=2),
    "window_ring_2": AttentionCase(None, 40, window=13, ring=2, left_padding=(0,)),
    "documents_and_window_ring_4": AttentionCase(((3, 9, 1, 30), (43,)), 43, 7, ring=4),
    "left_padding_ring_2": AttentionCase(None, 30, window=12, left_padding=(7, 0), ring=2),
    "one_query_rounds_grouped_heads": AttentionCase(((2, 1, 8, 4, 3, 3, 1),), 22, ring=8),
    "far_window": FAR_WINDOW,
    "ulysses_2_ring_4": AttentionCase(((50, 27), (77,)), 77, 11, ulysses=2, ring=4, heads=(8, 2)),
}


@pytest.mark.parametrize("case", RING_CASES.values(), ids=RING_CASES.keys())
def test_ring_attentions_cuda_arguments_compute_exact_masked_attention(case):
    _assert_exact(ring_errors(case), case)


def test_the_kernel_check_on_a_gpu_meets_both_of_flashs_rules_about_its_maxima():
    """gpu-check, the probe and a ring job's start check run these layouts on the device: a
    round whose right window side reaches its longest key run (dropped, before the fix, and
    re-bounded) and a round of single queries over grouped heads without a window (the
    decoding branch, before the fix)."""
    cases = {case.name: case for case in kernel_check._CASES}
    short = kernel_check._ring_rounds(cases["ring rounds past a short key run"])
    assert any(r.rule[0] >= 0 and r.rule[1] >= r.max_k for r in short)
    single = kernel_check._ring_rounds(cases["ring rounds of single queries"])
    assert any(r.rule == (-1, -1) and r.max_q == 1 for r in single)
    assert kernel_check._HEADS > kernel_check._KV_HEADS


CASES = 150


@pytest.mark.slow
def test_property_every_drawn_layout_computes_exact_attention_on_both_cuda_paths():
    """150 seeded cases, forward and backward: documents (one token up to whole rows), windows
    (one key up to past the row), left padding, under Ulysses {1, 2, 4} x ring {2, 4, 8}, rows
    of lengths divisible by nothing in particular; document attention on the same rows without
    the ring. Before the maxima were fixed, one ring in 36 of such draws dropped keys or took
    the decoding branch."""
    rng = random.Random(48)
    mismatches = []
    for seed in range(CASES):
        ring = draw_case(rng)
        for path, case in (("ring", ring), ("documents", dataclasses.replace(ring, ring=1))):
            errors = ring_errors if path == "ring" else document_errors
            try:
                got: object = errors(case, seed)
            except FlashContractError as err:
                got = str(err)
            if not isinstance(got, dict) or any(e > EXACT for e in got.values()):
                mismatches.append((path, case, got))
    assert not mismatches, f"{len(mismatches)} of {2 * CASES} mismatched: {mismatches[:5]}"
