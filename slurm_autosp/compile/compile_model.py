"""Apply the AutoSP backend to a whole model or to each decoder layer.

Per-layer compilation keeps compile time flat in depth: all decoder layers share one code
object, and with no KV cache nothing in a layer's trace depends on which layer it is (HF's
`layer_idx` is only read by `cache.update`), so one graph serves every layer. The caller must
run the model with `use_cache=False`, as `SPBatch.model_kwargs()` does.
"""

import torch
from transformers import PreTrainedModel

from slurm_autosp.compile.backend import AutoSPBackend, AutoSPCompileError
from slurm_autosp.compile.hf_attention import use_sp_attention


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model: the modules its `_no_split_modules` names.

    A class is matched along its MRO, so layers FSDP2's `fully_shard` has already wrapped
    (it swaps in a subclass named FSDP<Layer>) are still found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise AutoSPCompileError(
            f"cannot find the decoder layers of {type(model).__name__} for per-layer compilation "
            f"(looked for modules named in _no_split_modules={sorted(names)}); compile the whole "
            "model instead (per_layer=False)"
        )
    return layers


def compile_model(
    model: torch.nn.Module, backend: AutoSPBackend, *, per_layer: bool, dynamic: bool | None = None
) -> None:
    """Compile `model` in place with `backend`: as one model, or each decoder layer alone.

    HF models are first switched to the SP attention function (see hf_attention). `dynamic`
    goes to torch.compile. Per layer, mark_dynamic on the model's inputs does not reach the
    layers: with dynamic=None a second sequence length recompiles once with a symbolic length;
    dynamic=True also makes float attributes symbolic, which inductor answers with a retrace.
    """
    if isinstance(model, PreTrainedModel):
        use_sp_attention(model)
    targets = decoder_layers(model) if per_layer else [model]
    for target in targets:
        target.compile(backend=backend, dynamic=dynamic)
