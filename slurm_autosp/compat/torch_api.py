"""torch's private names that slurm_autosp uses: the compiler's, the plan's layer tracing and
the CUDA kernel of document attention (the flash varlen forward and backward that
torch.nn.attention.varlen calls, with its arguments), and the reset of DTensor's sharding
caches, which outlive the process groups of their meshes, and the flattening of a device
mesh's dimensions into one (as torchtitan does: no public name yet); the hook in a module's call that
runs outside its compiled frame; a DTensor made over a host copy of its shard; and the abort of
every process group of a rank that failed."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._dynamo import config as dynamo_config
from torch._dynamo import maybe_mark_dynamic
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx, partition_fn
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.runtime import cache_dir_utils as _inductor_cache_dir_utils
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.cuda._pin_memory_utils import pin_memory as register_pinned
from torch.cuda._pin_memory_utils import unpin_memory as unregister_pinned
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _abort_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache as clear_sharding_prop_cache

GroupOptions = _C10dBackend.Options  # a process group's backend options (its timeout among them)

# (query, key, value [T, H, D], cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
#  return_debug_mask, *, scale, window_size_left, window_size_right, ...)
#  -> (output [T, Hq, D], logsumexp [Hq, T] fp32, rng_state, unused, debug_attn_mask)
flash_attention_forward = torch.ops.aten._flash_attention_forward.default
# (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
#  is_causal, rng_state, unused, *, scale, window_size_left, window_size_right) -> (dq, dk, dv)
flash_attention_backward = torch.ops.aten._flash_attention_backward.default


def flash_varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sequences: tuple[torch.Tensor, torch.Tensor, int, int],
    causal: bool,
    window: tuple[int, int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash's varlen forward without dropout, as torch.nn.attention.varlen calls it:
    `sequences` (cum_seq_q, cum_seq_k, max_q, max_k), `window` (left, right). Returns the output
    [T, Hq, D] and its log-sum-exp [Hq, T] (fp32)."""
    output, lse, *_ = flash_attention_forward(
        query,
        key,
        value,
        *sequences,
        0.0,
        causal,
        False,
        scale=scale,
        window_size_left=window[0],
        window_size_right=window[1],
    )
    return output, lse


def flash_varlen_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    sequences: tuple[torch.Tensor, torch.Tensor, int, int],
    causal: bool,
    window: tuple[int, int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash's varlen backward of `flash_varlen_forward`'s call, from its output and
    log-sum-exp [Hq, T]: the gradients of query, key and value."""
    grad_q, grad_k, grad_v = flash_attention_backward(
        grad_output,
        query,
        key,
        value,
        output,
        lse,
        *sequences,
        0.0,
        causal,
        torch.zeros(2, dtype=torch.uint64, device=query.device),  # no dropout: varlen_attn's
        torch.empty(0, device=query.device),
        scale=scale,
        window_size_left=window[0],
        window_size_right=window[1],
    )
    return grad_q, grad_k, grad_v


__all__ = [
    "CustomGraphPass",
    "FakeTensorMode",
    "GroupOptions",
    "aot_module_simplified",
    "clear_sharding_prop_cache",
    "compile_fx",
    "dtensor_over",
    "dynamo_config",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_refusal",
    "flash_varlen_backward",
    "flash_varlen_forward",
    "flatten_mesh",
    "inductor_config",
    "inductor_default_cache_dir",
    "maybe_mark_dynamic",
    "new_group_options",
    "partition_fn",
    "register_pinned",
    "run_and_save_rng_state",
    "run_with_rng_state",
    "select_decomp_table",
    "unregister_pinned",
    "wrap_module_call",
]


def flash_refusal(query: torch.Tensor) -> tuple[str, bool]:
    """What torch's CUDA flash kernel would fail on for this query (empty when nothing), and
    whether the precision is the cause (train.precision=bf16 fixes it)."""
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"computes in bf16 or fp16, not {query.dtype}", True
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"takes head dimensions that are multiples of 8 up to 256, not {head_dim}", False
    return "", False


def flatten_mesh(mesh: DeviceMesh, name: str, group: tuple[str, GroupOptions]) -> DeviceMesh:
    """`mesh`'s dimensions as one named `name`, over a group of its own made with `group`'s
    (backend, options) (not the world's default group where it spans the world)."""
    return mesh._flatten(name, backend_override=group)


def new_group_options(device: torch.device) -> GroupOptions:
    """Options for a new group on the world's backend that carry the world's timeout: torch
    gives a new group its backend's default timeout (10 minutes for NCCL), not the one the
    world was given. Read by DeviceMesh as each group's timeout."""
    world = dist.group.WORLD._get_backend(device)  # type: ignore[union-attr]
    options: GroupOptions
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl.is_high_priority_stream = False  # as torch's own default for a new group
        options = nccl
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = world.options._timeout
    return options


def abort_process_groups() -> None:
    """Tear down every process group of this process without waiting for its collectives:
    NCCL's destroy waits for every kernel it enqueued, and a rank that failed may have left
    some its peers never join. gloo closes its connections, which releases peers waiting."""
    _abort_process_group()


def inductor_default_cache_dir() -> str:
    """Inductor's cache directory when TORCHINDUCTOR_CACHE_DIR is unset; importing
    torch._dynamo exports it as TORCHINDUCTOR_CACHE_DIR."""
    return os.path.abspath(_inductor_cache_dir_utils.default_cache_dir())


def dtensor_over(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor of `like`'s mesh, placements and shape whose local shard is `local`, where it
    is: DTensor.from_local would move a host copy to the mesh's device (DTensor's own
    constructor, as torch's checkpoint stager makes its host copies)."""
    return DTensor(local, like._spec, requires_grad=False)


def wrap_module_call(
    module: torch.nn.Module, around: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Make every call of `module` go through `around(call)`, where `call` is what the call ran
    before: its compiled call (`Module.compile`) or its plain one. The wrapper runs outside
    Dynamo's frame, where work that must not be traced (a collective waited for, an exception
    raised on purpose) can run between a model's compiled layers."""
    call = module._compiled_call_impl or module._call_impl
    module._compiled_call_impl = around(call)  # what Module._wrapped_call_impl calls first
