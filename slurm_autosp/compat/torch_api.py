"""torch's private names that slurm_autosp uses: the compiler's and the plan's layer tracing."""

from __future__ import annotations

import os

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

__all__ = [
    "CustomGraphPass",
    "FakeTensorMode",
    "aot_module_simplified",
    "compile_fx",
    "dynamo_config",
    "inductor_config",
    "inductor_default_cache_dir",
    "maybe_mark_dynamic",
    "partition_fn",
    "register_pinned",
    "run_and_save_rng_state",
    "run_with_rng_state",
    "select_decomp_table",
    "unregister_pinned",
]


def inductor_default_cache_dir() -> str:
    """Inductor's cache directory when TORCHINDUCTOR_CACHE_DIR is unset; importing
    torch._dynamo exports it as TORCHINDUCTOR_CACHE_DIR."""
    return os.path.abspath(_inductor_cache_dir_utils.default_cache_dir())
