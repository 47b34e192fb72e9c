"""How exact the attention kernels of packed documents and windows are on a device: against
their CPU kernels in fp32 on the same inputs, forward and backward, with grouped KV heads and
two rows. Document attention (Ulysses) for packed documents, a window within them and a window
over whole rows; ring attention's rounds (`varlen_kernel`) within documents and within a
window, each piece one sequence under flash's (left, right) rule, and two layouts that meet
flash's own rules about its arguments (tests/flash_contract.py models them): rounds whose
queries lie further past their keys than the round's longest key run, and rounds of single
queries over grouped KV heads.

On a GPU this checks the flash varlen kernel, which nothing else runs on numbers before a
job does (tests check its shapes on a fake device, and its arguments through a CPU model of
its contract); with `device="cpu"` it checks the CPU kernel in bf16, a self-check of the
reference path that runs anywhere.

The inputs are drawn in fp32 and rounded to `dtype`; the reference sees those rounded values
in fp32, so what is measured is the kernel's own arithmetic. Each error is the largest
absolute difference from the reference over the reference's largest magnitude. The bounds
are set for bf16, whose 8 significant bits round a value by up to 2^-8 = 3.9e-3 of itself:
the output is rounded once after an fp32 accumulation, over probabilities themselves rounded
to bf16 before they weight the values (on the GPU), so OUTPUT_BOUND = 2e-2 allows about five
such roundings; a gradient goes through more bf16 intermediates (dP, dS) and sums over keys
and query heads, so GRADIENT_BOUND = 4e-2 allows twice that. Measured on CPU (seeds 0-2): the
CPU kernel in bf16 stays within 2.9e-3 (output) and 8.0e-3 (gradients), in fp16 within 8.6e-4;
a window one key too wide, the smallest mistake a kernel could make here, errs by 0.13-0.28.
fp16 and fp32 are more precise than bf16, so the same bounds hold for them.
"""

from dataclasses import dataclass

import torch

from slurm_autosp.sp.document_attention import document_attention, document_spans
from slurm_autosp.sp.ring_plan import Round, ring_plan
from slurm_autosp.sp.varlen_kernel import varlen_backward, varlen_forward

OUTPUT_BOUND = 2e-2
GRADIENT_BOUND = 4e-2

_BATCH, _HEADS, _KV_HEADS, _SEQ, _HEAD_DIM = 2, 4, 2, 256, 64
_DOCUMENTS = ((37, 1, 90, 128), (200, 56))  # a single token, shorter and longer than the window
_WINDOW = 48


@dataclass(frozen=True)
class KernelCheck:
    """One case on one device: each error is max |kernel - reference| / max |reference|."""

    case: str
    device: str
    dtype: str
    output: float
    grad_query: float
    grad_key: float
    grad_value: float

    @property
    def passed(self) -> bool:
        gradients = max(self.grad_query, self.grad_key, self.grad_value)
        return self.output <= OUTPUT_BOUND and gradients <= GRADIENT_BOUND


@dataclass(frozen=True)
class _Case:
    """Two rows of documents of these lengths (None: each row one), a window (0: none); under
    a ring of `ring` ranks ring attention's rounds, else document attention."""

    name: str
    documents: tuple[tuple[int, ...], ...] | None
    window: int
    ring: int = 1


_CASES = (
    _Case("packed documents", _DOCUMENTS, window=0),
    _Case("window within documents", _DOCUMENTS, window=_WINDOW),
    _Case("window over whole rows", None, window=_WINDOW),
    _Case("ring rounds within documents", _DOCUMENTS, window=0, ring=2),
    _Case("ring rounds within a window", _DOCUMENTS, window=_WINDOW, ring=2),
    _Case(
        "ring rounds past a short key run",
        ((98, 23, 46, 89), (8, 17, 29, 71, 89, 15, 27)),
        window=69,
        ring=2,
    ),
    _Case(
        "ring rounds of single queries",
        ((33, 64, 48, 48, 63), (65, 16, 64, 16, 48, 16, 31)),
        window=0,
        ring=2,
    ),
)
CASES = tuple(case.name for case in _CASES)


def _boundaries(case: _Case) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) of the case's rows laid end to end, and the longest document."""
    assert case.documents is not None
    lengths = [length for row in case.documents for length in row]
    starts = torch.tensor([0, *lengths]).cumsum(0)
    return starts.to(torch.int32), max(lengths)


def _attention(
    inputs: list[torch.Tensor], case: _Case, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The op's output and its gradients for `inputs` (query, key, value, output gradient),
    computed on `device` in `dtype`, returned on the CPU in fp32."""
    query, key, value, grad_output = (t.to(device, dtype) for t in inputs)
    leaves = [t.requires_grad_() for t in (query, key, value)]
    cu_seqlens, longest = _boundaries(case) if case.documents else (None, 0)
    output, _ = document_attention(
        *leaves,
        None if cu_seqlens is None else cu_seqlens.to(device),
        _HEAD_DIM**-0.5,
        case.window,
        longest,
    )
    grads = torch.autograd.grad(output, leaves, grad_output)
    return [t.detach().float().cpu() for t in (output, *grads)]


def _ring_rounds(case: _Case) -> list[Round]:
    """Every round of the case's ring: each rank's, against each block."""
    documents = tuple(document_spans(_boundaries(case)[0], _BATCH, _SEQ))
    plan = ring_plan(case.ring, _SEQ // case.ring, documents, case.window, True)
    return [r for rank in plan.rounds for source in rank for r in source]


def _ring_attention(
    inputs: list[torch.Tensor], case: _Case, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The rounds' outputs and gradients (each round's own attention) over a rank's tokens (the
    first 1/ring of each row), on `device` in `dtype`, concatenated, on the CPU in fp32."""
    tokens = [t[:, :, : _SEQ // case.ring].transpose(1, 2).flatten(0, 1) for t in inputs]
    query, key, value, grad_output = (t.to(device, dtype) for t in tokens)
    results: list[list[torch.Tensor]] = [[], [], [], []]
    for round_ in _ring_rounds(case):
        q_index, k_index, _, _ = round_.on(device)
        q, k, v, g = query[q_index], key[k_index], value[k_index], grad_output[q_index]
        output, lse = varlen_forward(q, k, v, round_, _HEAD_DIM**-0.5)
        grads = varlen_backward(g, q, k, v, output, lse, round_, _HEAD_DIM**-0.5)
        for held, t in zip(results, (output, *grads), strict=True):
            held.append(t.detach().float().cpu().flatten())
    return [torch.cat(held) for held in results]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def check_document_kernel(
    device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> list[KernelCheck]:
    """Document attention on `device` in `dtype` against its CPU kernel in fp32, one
    `KernelCheck` per case; `passed` compares it with OUTPUT_BOUND and GRADIENT_BOUND."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    shapes = [(_HEADS, _SEQ), (_KV_HEADS, _SEQ), (_KV_HEADS, _SEQ), (_HEADS, _SEQ)]
    inputs = [
        torch.randn(_BATCH, heads, seq, _HEAD_DIM, generator=generator).to(dtype).float()
        for heads, seq in shapes
    ]
    results = []
    for case in _CASES:
        attention = _ring_attention if case.ring > 1 else _attention
        got = attention(inputs, case, device, dtype)
        want = attention(inputs, case, torch.device("cpu"), torch.float32)
        errors = [_relative_error(g, w) for g, w in zip(got, want, strict=True)]
        results.append(KernelCheck(case.name, str(device), str(dtype), *errors))
    return results
