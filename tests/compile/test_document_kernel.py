"""Document attention's CUDA kernel (torch's flash varlen forward and backward), checked where
no GPU is: on fake CUDA tensors, where torch's own meta kernels of the flash ops give every
shape, stride and dtype and any read of a tensor's data raises. It returns exactly what the
op's fake declares (inductor compiles against the fake and asserts it at run time), calls the
flash ops with the window, scale and sequences the CPU kernel applies, and never waits for
the GPU. Its numbers are checked by kernel_check, on a GPU; here that check runs on CPU."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils._python_dispatch import TorchDispatchMode

import slurm_autosp.sp.kernel_check as kernel_check
import slurm_autosp.sp.varlen_kernel as varlen_kernel
from slurm_autosp.compat.torch_api import (
    FakeTensorMode,
    flash_attention_backward,
    flash_attention_forward,
)
from slurm_autosp.sp.document_attention import (
    DocumentAttentionError,
    document_attention,
    document_attention_backward,
    varlen_backward,
    varlen_forward,
)
from slurm_autosp.sp.kernel_check import (
    GRADIENT_BOUND,
    OUTPUT_BOUND,
    check_document_kernel,
)

SCALE = 0.125
HEADS, KV_HEADS, SEQ, DIM = 4, 2, 24, 64
LENGTHS = (5, 1, 18, 13, 11)  # two rows of 24: a single token, longer and shorter than windows


@dataclass(frozen=True)
class Case:
    batch: int = 2
    documents: bool = True
    window: int = 0
    head_major: bool = False  # inputs as the all-to-all returns them, not as HF's projections


CASES = {
    "packed_rows": Case(),
    "window_within_documents": Case(window=7),
    "window_over_whole_rows": Case(documents=False, window=7),
    "two_rows_after_the_all_to_all": Case(head_major=True),
    "one_row_after_the_all_to_all": Case(batch=1, window=7, head_major=True),
}


def _fake_inputs(case: Case) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
    """q, k, v [B, H, S, D] in bf16 on the fake CUDA device (grouped KV heads), the document
    boundaries (no data: reading them raises) and the longest document."""

    def tensor(heads: int) -> torch.Tensor:
        if case.head_major:
            return torch.empty(case.batch, heads, SEQ, DIM, dtype=torch.bfloat16, device="cuda")
        shape = (case.batch, SEQ, heads, DIM)
        return torch.empty(shape, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

    lengths = LENGTHS[:3] if case.batch == 1 else LENGTHS
    boundaries = torch.empty(len(lengths) + 1, dtype=torch.int32, device="cuda")
    qkv = [tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)]
    return qkv, boundaries if case.documents else None, max(lengths) if case.documents else 0


def _layout(tensor: torch.Tensor) -> tuple:
    """What inductor asserts of an op's output against its fake: shape, the strides of every
    dimension longer than 1 (nothing indexes the others), dtype, device."""
    strides = tuple(s for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1)
    return tensor.shape, strides, tensor.dtype, tensor.device


class FlashCalls(TorchDispatchMode):
    """Records the flash ops' calls (then runs them: on fake tensors, their meta kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (flash_attention_forward, flash_attention_backward):
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cuda_kernel_returns_what_the_fake_declares_forward_and_backward(case):
    with FakeTensorMode():
        (query, key, value), boundaries, longest = _fake_inputs(case)
        arguments = (boundaries, SCALE, case.window, longest)
        declared = document_attention(query, key, value, *arguments)  # the op's fake
        output, logsumexp = varlen_forward(query, key, value, *arguments)
        grad_output = torch.empty_like(query)
        declared_grads = document_attention_backward(
            grad_output, query, key, value, output, logsumexp, *arguments
        )
        grads = varlen_backward(grad_output, query, key, value, output, logsumexp, *arguments)
    got = [_layout(t) for t in (output, logsumexp, *grads)]
    assert got == [_layout(t) for t in (*declared, *declared_grads)]
    assert logsumexp.dtype == torch.float32 and output.dtype == torch.bfloat16
    assert [g.shape[1] for g in grads] == [HEADS, KV_HEADS, KV_HEADS]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cuda_kernel_calls_flash_with_the_cpu_kernels_window_scale_and_documents(case):
    """One forward and one backward call over the whole batch: causal (-1, 0) or a window of
    W keys as (W - 1, 0), the same scale, boundaries and longest document both ways, the KV
    heads not repeated; the rows alone are the sequences when there are no documents."""
    with FakeTensorMode(), FlashCalls() as recorded:
        (query, key, value), boundaries, longest = _fake_inputs(case)
        arguments = (boundaries, SCALE, case.window, longest)
        output, logsumexp = varlen_forward(query, key, value, *arguments)
        varlen_backward(torch.empty_like(query), query, key, value, output, logsumexp, *arguments)
    (forward, f_args, f_kwargs), (backward, b_args, b_kwargs) = recorded.calls
    assert (forward, backward) == (flash_attention_forward, flash_attention_backward)
    tokens = case.batch * SEQ
    assert [tuple(t.shape) for t in f_args[:3]] == [
        (tokens, HEADS, DIM),
        (tokens, KV_HEADS, DIM),
        (tokens, KV_HEADS, DIM),
    ]
    window = (case.window - 1, 0) if case.window else (-1, 0)
    for args, kwargs, sequences_at in ((f_args, f_kwargs, 3), (b_args, b_kwargs, 6)):
        assert (kwargs["window_size_left"], kwargs["window_size_right"]) == window
        assert kwargs["scale"] == SCALE
        assert args[sequences_at + 4] == 0.0, "no dropout"
        assert args[sequences_at + 5] is (case.window == 0), "causal exactly when no window"
        assert args[sequences_at + 2 : sequences_at + 4] == (longest or SEQ,) * 2
        assert args[sequences_at] is args[sequences_at + 1]
        if case.documents:
            assert args[sequences_at] is boundaries
        else:
            assert args[sequences_at].shape == (case.batch + 1,)
            assert args[sequences_at].dtype == torch.int32


def test_fake_mode_catches_a_read_of_the_boundaries_which_the_kernel_never_makes():
    """Any host read of a CUDA tensor's data (.tolist(), .item()) raises on fake tensors: the
    tests above running through means the kernel reads none, in any layer."""
    with FakeTensorMode():
        (query, key, value), boundaries, longest = _fake_inputs(Case())
        with pytest.raises(DataDependentOutputException):
            boundaries.tolist()
        varlen_forward(query, key, value, boundaries, SCALE, 0, longest)


def test_cuda_kernel_refuses_what_flash_does_not_compute_by_name(monkeypatch):
    with FakeTensorMode():
        (query, key, value), boundaries, longest = _fake_inputs(Case())
        with pytest.raises(DocumentAttentionError, match="train.precision=bf16"):
            varlen_forward(query.float(), key.float(), value.float(), boundaries, SCALE, 0, 13)
        with pytest.raises(DocumentAttentionError, match="multiples of 8 up to 256, not 60"):
            odd = torch.empty(2, HEADS, SEQ, 60, dtype=torch.bfloat16, device="cuda")
            varlen_forward(odd, key, value, boundaries, SCALE, 0, longest)
        with pytest.raises(DocumentAttentionError, match="cu_seqlens without max_length"):
            varlen_forward(query, key, value, boundaries, SCALE, 0, 0)
        with pytest.raises(DocumentAttentionError, match="window=-1: a sliding window is a"):
            varlen_forward(query, key, value, boundaries, SCALE, -1, longest)
        monkeypatch.setattr(torch.version, "hip", "6.2")
        with pytest.raises(DocumentAttentionError, match=r"ROCm \(cluster.vendor=amd\)"):
            varlen_forward(query, key, value, boundaries, SCALE, 0, longest)


# ------------------------------------------------------------------ kernel_check, on CPU


def test_kernel_check_on_cpu_passes_bf16_and_measures_its_rounding():
    """device="cpu" checks the CPU kernel in bf16 against itself in fp32: every case passes,
    with errors that are bf16's (not 0, well inside the bounds), and fp32 matches exactly."""
    checks = check_document_kernel("cpu")
    assert [c.case for c in checks] == [
        "packed documents",
        "window within documents",
        "window over whole rows",
        "ring rounds within documents",
        "ring rounds within a window",
        "ring rounds past a short key run",
        "ring rounds of single queries",
    ]
    for check in checks:
        errors = (check.output, check.grad_query, check.grad_key, check.grad_value)
        assert check.passed and (check.device, check.dtype) == ("cpu", "torch.bfloat16")
        assert 1e-4 < check.output < OUTPUT_BOUND / 4
        assert all(1e-4 < e < GRADIENT_BOUND / 4 for e in errors[1:])
    assert all(c.output == c.grad_key == 0.0 for c in check_document_kernel("cpu", torch.float32))


def test_kernel_check_fails_a_kernel_whose_window_is_one_key_too_wide(monkeypatch):
    def one_key_too_wide(query, key, value, cu_seqlens, scale, window, max_length):
        if query.dtype != torch.float32 and window:  # the kernel under test, not the reference
            window += 1
        return document_attention(query, key, value, cu_seqlens, scale, window, max_length)

    monkeypatch.setattr(kernel_check, "document_attention", one_key_too_wide)
    passed = {c.case: c.passed for c in check_document_kernel("cpu")}
    assert passed == {
        "packed documents": True,
        "window within documents": False,
        "window over whole rows": False,
        "ring rounds within documents": True,
        "ring rounds within a window": True,
        "ring rounds past a short key run": True,
        "ring rounds of single queries": True,
    }


def test_kernel_check_fails_ring_rounds_whose_window_is_one_key_too_wide(monkeypatch):
    """A flash rule read one key wider on the left, the smallest mistake a ring kernel could
    make: only the windowed rounds err."""
    mask = varlen_kernel._mask

    def one_key_too_wide(piece, dtype):
        if dtype != torch.float32 and piece.left >= 0:  # the kernel under test, not the reference
            piece = dataclasses.replace(piece, left=piece.left + 1)
        return mask(piece, dtype)

    monkeypatch.setattr(varlen_kernel, "_mask", one_key_too_wide)
    passed = {c.case: c.passed for c in check_document_kernel("cpu")}
    assert passed == {
        "packed documents": True,
        "window within documents": True,
        "window over whole rows": True,
        "ring rounds within documents": True,
        "ring rounds within a window": False,
        "ring rounds past a short key run": False,
        "ring rounds of single queries": True,
    }
