"""What an HF model hands its attention function, read off one forward on fake tensors.

The heads Ulysses splits are those of the tensors attention receives, not a config field's:
an MLA model (DeepSeek-V2/V3) expands its key/value heads from one latent to every query
head, whatever `num_key_value_heads` says. So admission builds the model under FakeTensorMode
(nothing allocated, whatever its size), runs it up to its first attention call and reads the
query and key/value heads there, what the call asks for (`check_attention_call`), and whether
HF's own attention computes on what it received. The forward stops there: what follows (a
mixture of experts' data-dependent routing) does not run on fake tensors, and every layer's
attention is checked again where the model runs. A model that fails in its first attention,
or before it in its own Python (a TypeError, KeyError, ...), fails on its own, without AutoSP:
it is named before any rank starts. A RuntimeError before attention may be the fake tensors'
limit rather than the model's: the trace then says nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from slurm_autosp.compat.torch_api import FakeTensorMode
from slurm_autosp.sp.attention_pattern import UnsupportedAttention, check_attention_call

TRACE_ATTENTION = "slurm_autosp_trace"
_TRACE_TOKENS = 16


@dataclass(frozen=True)
class TracedAttention:
    """The first attention call of a model's forward. `layer` None: none was reached (the
    model failed first, `failure`, or calls attention some other way)."""

    layer: str | None = None  # the attention module's class, e.g. "DeepseekV3Attention"
    query_heads: int = 0
    kv_heads: int = 0  # key (and value) heads as the attention function receives them
    unsupported: list[str] = field(default_factory=list)  # what the call asks that AutoSP ignores
    sinks: list[str] = field(default_factory=list)  # "attention sinks (name of Layer)"
    failure: str | None = None  # the model's own error on this config, before or in attention
    # the trace stopped before attention where fake tensors cannot follow (data-dependent
    # routing, a kernel's own dtype check): nothing is known, nothing is refused
    stopped: str | None = None


class _Reached(Exception):
    """Raised by the recording attention function to end the forward at its first call."""

    def __init__(self, traced: TracedAttention) -> None:
        super().__init__(traced.layer)
        self.traced = traced


def _record(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    """The attention function of a traced model: records the call, runs HF's SDPA attention on
    it (a model that breaks there breaks without AutoSP too), and ends the forward."""
    name = type(module).__name__
    unsupported = []
    asked = {k: v for k, v in kwargs.items() if k != "s_aux"}  # sinks: named by parameter
    try:
        check_attention_call(module, asked)
    except UnsupportedAttention as refused:
        unsupported.append(str(refused))
    if attention_mask is not None:
        unsupported.append(
            f"{name} receives an attention mask the model builds itself, not through transformers' "
            "mask interface; AutoSP attends causally without one"
        )
    failure = None
    if value.shape[1] != key.shape[1]:
        failure = f"{name} passes {key.shape[1]} key heads but {value.shape[1]} value heads"
    try:
        sdpa_attention_forward(module, query, key, value, None, **{**asked, "softcap": None})
    except Exception as error:  # noqa: BLE001 - the model's own failure, reported by name
        failure = failure or f"{type(error).__name__}: {error}"
    raise _Reached(
        TracedAttention(name, query.shape[1], key.shape[1], unsupported, failure=failure)
    )


AttentionInterface.register(TRACE_ATTENTION, _record)
AttentionMaskInterface.register(TRACE_ATTENTION, lambda **_: None)


def _sinks(model: torch.nn.Module) -> list[str]:
    """Sinks are learned parameters of the attention module, not a config field: named from the
    decoder layer that holds them (its `_no_split_modules` class)."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            names = [n for n, _ in module.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"]
            if names:
                return [f"attention sinks ({names[0]} of {type(module).__name__})"]
    names = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] == "sinks"]
    return [f"attention sinks ({names[0]})"] if names else []


def trace_attention(config: PretrainedConfig) -> TracedAttention:
    """The first attention call of the model `config` builds; kept for the process (admission
    asks again for every command and sequence length, and a large model takes seconds)."""
    key = config.to_json_string(use_diff=False)
    if key not in _TRACES:
        _TRACES[key] = _trace(copy.deepcopy(config))
    return _TRACES[key]


_TRACES: dict[str, TracedAttention] = {}


@contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors log every op that fails on them with its traceback; here such a failure is
    an answer (the model's own, or where the trace stops), reported by name."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _trace(config: PretrainedConfig) -> TracedAttention:
    sinks: list[str] = []
    with _quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            sinks = _sinks(model)
            model.set_attn_implementation(TRACE_ATTENTION)
            tokens = torch.zeros(1, _TRACE_TOKENS, dtype=torch.long)
            model(
                input_ids=tokens,
                position_ids=torch.arange(_TRACE_TOKENS)[None],
                use_cache=False,
            )
        except _Reached as reached:
            return dataclasses.replace(reached.traced, sinks=sinks)
        except RuntimeError as error:  # an op on fake tensors: maybe the model's, maybe the trace's
            return TracedAttention(sinks=sinks, stopped=f"{type(error).__name__}: {error}")
        except Exception as error:  # noqa: BLE001 - the model's own failure, reported by name
            return TracedAttention(sinks=sinks, failure=f"{type(error).__name__}: {error}")
    return TracedAttention(sinks=sinks)
