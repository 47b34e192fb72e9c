"""Apply the AutoSP backend to a whole model or to each decoder layer.

Per-layer compilation keeps compile time flat in depth: all decoder layers share one code
object, and with no KV cache nothing in a layer's trace depends on which layer it is (HF's
`layer_idx` is only read by `cache.update`), so one graph serves every layer (one pair, before
and after the MLP, when the MLPs are tiled: see tiling). The caller must run the model with
`use_cache=False`, as `SPBatch.model_kwargs()` does.

Sequence tiling tiles what the checkpointing policy recomputes: under `full` (the layer keeps
only its input) the whole layer outside attention runs in tiles (tiled_layer), and its tiles,
not the layers, are compiled; under the other policies, which keep attention's tensors, only
the MLPs (tiling).
"""

import torch
from transformers import PreTrainedModel

from slurm_autosp.compat.torch_api import dynamo_config
from slurm_autosp.compile.backend import AutoSPBackend
from slurm_autosp.compile.hf_attention import use_sp_attention
from slurm_autosp.compile.layers import decoder_layers
from slurm_autosp.compile.tiled_layer import tile_layers, tiles_whole_layers
from slurm_autosp.compile.tiling import tile_mlps


def compile_model(
    model: torch.nn.Module,
    backend: AutoSPBackend,
    *,
    per_layer: bool,
    dynamic: bool | None = None,
    tile_tokens: int = 0,
) -> None:
    """Compile `model` in place with `backend`: as one model, or each decoder layer alone.

    HF models are first switched to the SP attention function (see hf_attention). `dynamic`
    goes to torch.compile. Per layer, mark_dynamic on the model's inputs does not reach the
    layers: with dynamic=None a second sequence length recompiles once with a symbolic length;
    dynamic=True also makes float attributes symbolic, which inductor answers with a retrace.
    `tile_tokens` > 0 makes every decoder layer (under `full`) or its MLP (otherwise) run over
    tiles of that many tokens; 0 leaves the layers as they are.
    """
    if isinstance(model, PreTrainedModel):
        use_sp_attention(model)
    whole_layers = (
        bool(tile_tokens)
        and isinstance(backend, AutoSPBackend)
        and tiles_whole_layers(backend.checkpointing)
    )
    if whole_layers:
        tile_layers(model, tile_tokens, backend, dynamic)
    elif tile_tokens:
        tile_mlps(model, tile_tokens)
    # Past Dynamo's recompile limit a frame runs eagerly: the attention would run unrewritten,
    # each rank attending within its own shard, silently wrong. Fail instead.
    dynamo_config.fail_on_recompile_limit_hit = True
    if whole_layers and per_layer:
        return  # tile_layers compiled the tiles
    targets = decoder_layers(model) if per_layer else [model]
    for target in targets:
        target.compile(backend=backend, dynamic=dynamic)
