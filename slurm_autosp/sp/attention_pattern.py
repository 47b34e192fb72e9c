"""Which attention a Hugging Face model asks for, against what the AutoSP graph computes.

The compiled graph computes causal self-attention over the whole sequence, within each packed
document, and within a sliding window on the layers whose config asks for one (`layer_window`:
what the layer passes its attention function, checked against its config's layer types).
Anything else a model's layers ask for — a chunk shorter than the sequence, logit soft-capping,
attention sinks, bidirectional attention, a mixing layer that is not attention — would be
computed wrongly without a word, so each is named and refused: from the config before a job
starts (`unsupported_attention`), and again where the model runs (`check_attention_call`,
`check_mask_request`), for models that reach AutoSP another way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from transformers import PretrainedConfig
from transformers.masking_utils import bidirectional_mask_function

FULL = "full_attention"
SLIDING = "sliding_attention"  # computed: a window within the document (document_attention)
CHUNKED = "chunked_attention"  # refused when the chunk is shorter than the sequence
# layers of a hybrid (Nemotron-H) that are an MLP alone: they mix no tokens
WITHOUT_MIXING = ("mlp", "moe")


class UnsupportedAttention(RuntimeError):
    """A model whose attention the AutoSP graph would not compute exactly."""


def window_matters(window: int | None, seq_len: int | torch.SymInt) -> bool:
    """A window (or chunk) of `window` tokens changes causal attention only when the sequence is
    longer: the farthest pair of a `seq_len` sequence is `seq_len - 1` tokens apart."""
    return window is not None and window != 0 and bool(seq_len > window)


def _layers(indices: list[int], total: int) -> str:
    shown = ", ".join(map(str, indices[:6])) + (", ..." if len(indices) > 6 else "")
    return f"layer{'s' if len(indices) > 1 else ''} {shown} of {total}"


def _layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention type; configs without `layer_types` (Mistral) window every layer."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    if getattr(config, "attention_chunk_size", None):
        return [CHUNKED] * layers
    if (
        getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True) is not False
    ):
        return [SLIDING] * layers
    return [FULL] * layers


def unsupported_attention(config: PretrainedConfig, seq_len: int) -> list[str]:
    """Every attention feature of `config` that AutoSP at `seq_len` tokens (padded to the SP
    size) would not compute exactly, each naming the config field; empty when it is exact."""
    problems = []
    types = _layer_types(config)
    for layer_type in dict.fromkeys(types):
        where = _layers([i for i, t in enumerate(types) if t == layer_type], len(types))
        if layer_type == CHUNKED:
            chunk = getattr(config, "attention_chunk_size", None)
            if window_matters(chunk, seq_len):
                problems.append(
                    f"chunked attention (attention_chunk_size={chunk} on {where}) over {seq_len} "
                    f"tokens: tokens of different chunks would attend to each other "
                    f"(data.seq_len <= {chunk} is exact)"
                )
        elif layer_type not in (FULL, SLIDING, *WITHOUT_MIXING):
            problems.append(
                f"{layer_type} ({where}) mixes tokens along the sequence outside attention"
            )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(f"attention logit soft-capping (attn_logit_softcapping={softcap})")
    if getattr(config, "use_bidirectional_attention", None):
        problems.append(
            "bidirectional attention (use_bidirectional_attention=true): AutoSP is causal only"
        )
    return problems


def windowed_attention(config: PretrainedConfig, seq_len: int) -> list[str]:
    """The windows of `config` that matter at `seq_len` tokens: computed exactly by
    `document_attention` (on GPUs its flash varlen kernel, which not every GPU job may run)."""
    types = _layer_types(config)
    window = getattr(config, "sliding_window", None)
    where = [i for i, t in enumerate(types) if t == SLIDING]
    if not where or not window_matters(window, seq_len):
        return []
    return [f"sliding-window attention (sliding_window={window} on {_layers(where, len(types))})"]


def check_attention_call(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse what an HF attention layer asks of its attention function that the graph ignores:
    soft-capping, sinks, a position bias, non-causal attention. (Windows: `layer_window`.)"""
    name = type(module).__name__
    if kwargs.get("softcap") is not None:
        raise UnsupportedAttention(
            f"{name} asks for attention logit soft-capping (softcap={kwargs['softcap']}), which AutoSP's "
            "attention does not apply; sequence parallelism does not support this model yet"
        )
    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttention(
            f"{name} has attention sinks, which AutoSP's attention does not apply; sequence parallelism "
            "does not support this model yet"
        )
    if kwargs.get("position_bias") is not None:
        raise UnsupportedAttention(
            f"{name} adds a position bias to the attention scores, which AutoSP's attention does not apply"
        )
    is_causal = kwargs.get("is_causal")
    if (getattr(module, "is_causal", True) if is_causal is None else is_causal) is False:
        raise UnsupportedAttention(
            f"{name} is not causal; AutoSP supports causal self-attention only"
        )


def layer_window(module: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The sliding window (in tokens) a layer's attention keeps, None for none: what the layer
    passes its attention function (`sliding_window`, as HF's flash-attention path reads it),
    refused when its config gives no layer that window (e.g. a layer passing none where every
    layer is windowed: it would window through the mask alone and attend wider here). The check
    is by config, not by layer index: reading `layer_idx` would make every layer its own graph."""
    asked = kwargs.get("sliding_window")
    config = getattr(module, "config", None)
    if config is None:
        return asked
    types = set(_layer_types(config))
    window = getattr(config, "sliding_window", None)
    allowed = ({window} if SLIDING in types else set()) | ({None} if types - {SLIDING} else set())
    if asked not in allowed:
        raise UnsupportedAttention(
            f"{type(module).__name__} passes sliding_window={asked} to its attention, but its config "
            f"gives its layers {sorted(types)} with sliding_window={window}; AutoSP applies the "
            "window the layer passes, so it must be one the config gives"
        )
    return asked


def _is_sliding_window(local_size: int, config: PretrainedConfig | None) -> bool:
    """Whether a mask of `local_size` is the config's sliding window (which the attention function
    applies, `layer_window`) rather than a chunk or anything else."""
    if config is None or getattr(config, "attention_chunk_size", None) == local_size:
        return False
    types = _layer_types(config)
    return SLIDING in types and getattr(config, "sliding_window", None) == local_size


def check_mask_request(
    mask_function: Callable[..., Any] | None,
    local_size: int | None,
    seq_len: int | torch.SymInt,
    config: PretrainedConfig | None,
    applies_windows: bool,
) -> None:
    """Refuse a mask the model asks for that is more than causal over `seq_len` tokens (the whole,
    padded sequence, not this rank's shard) and that the attention does not apply itself: a chunk
    shorter than it, a sliding window unless the attention `applies_windows`, or no causality."""
    model = getattr(config, "model_type", "the model")
    if applies_windows and local_size is not None and _is_sliding_window(local_size, config):
        local_size = None
    if isinstance(seq_len, torch.SymInt) and local_size is not None:
        if statically_known_true(seq_len <= local_size):  # decides without specialising the length
            return
        raise UnsupportedAttention(
            f"{model} asks for sliding-window or chunked attention of {local_size} tokens over a sequence whose "
            "length is symbolic while the whole model is traced, so AutoSP cannot tell whether the chunk "
            "matters; compile per decoder layer (per_layer=True), where the mask is requested eagerly"
        )
    if window_matters(local_size, seq_len):
        raise UnsupportedAttention(
            f"{model} asks for sliding-window or chunked attention of {local_size} tokens over a sequence of "
            f"{seq_len}; AutoSP attends causally over the whole sequence, so this would be silently wrong. "
            f"Train with sequences of at most {local_size} tokens, or without sequence parallelism"
        )
    if mask_function is bidirectional_mask_function:
        raise UnsupportedAttention(
            f"{model} asks for bidirectional attention; AutoSP supports causal self-attention only"
        )
