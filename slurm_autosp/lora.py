"""LoRA adapters by PEFT, injected into the Hugging Face model in place: its class, its decoder
layers and what the compiler and the engines see of them stay as they are; each adapted linear
becomes PEFT's `lora.Linear` (the frozen `base_layer` and the trained `lora_A`, `lora_B`).

What a run keeps of it: the adapters (checkpoints and the `adapter/` export, in PEFT's own
format), never the base, which every start reads again from `model.pretrained_path`; the
base's fingerprint, recorded in each checkpoint, refuses a resume on another one.

PEFT is imported where adapters are made or drawn: importing it takes seconds (it loads most
of transformers' model classes), which every rank, command and test process that adapts no
model would otherwise pay."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

from slurm_autosp.config import ConfigError, LoraConfig

if TYPE_CHECKING:
    import peft

ADAPTER_NAME = "default"  # PEFT's, which its state dicts and exports drop from the names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SAVED_PREFIX = "base_model.model."  # PeftModel.from_pretrained's names for the model's own
BASE_PART = ".base_layer."
ADAPTER_PARTS = (".lora_A.", ".lora_B.")
SAMPLE_BYTES = 1 << 16
SAMPLES_PER_FILE = 16


def peft_config(lora: LoraConfig, base: str | None = None) -> peft.LoraConfig:
    import peft

    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        base_model_name_or_path=base,
        task_type="CAUSAL_LM",
    )


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """The model with adapters on every linear layer `lora.target_modules` names, B zero (the
    model computes what it did), and only the adapters trainable."""
    import peft

    try:
        adapted = peft.inject_adapter_in_model(peft_config(lora), model, ADAPTER_NAME)
    except ValueError as err:  # PEFT's: no module of the model matches the names
        raise ConfigError(
            f"model.lora.target_modules={list(lora.target_modules)}: {err}. Name linear layers "
            "of the model (the last part of their names, e.g. q_proj, v_proj)"
        ) from err
    for name, param in adapted.named_parameters():
        param.requires_grad_(is_adapter(name))
    if problem := _unadaptable(adapted):
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: {problem}")
    return adapted


def _unadaptable(adapted: nn.Module) -> str | None:
    """Why a layer PEFT adapted cannot train here: not a linear layer (PEFT's embedding and
    convolution adapters name their weights otherwise), or a weight tied to another (a tied
    lm_head: its base is exported and checkpointed under the embedding's name)."""
    from peft.tuners.lora import Linear, LoraLayer

    uses = Counter(id(p) for _, p in adapted.named_parameters(remove_duplicate=False))
    for name, module in adapted.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        if not isinstance(module, Linear):
            return (
                f"{name} is a {type(base).__name__}, and LoRA here adapts linear layers only; "
                "leave it out"
            )
        if uses[id(base.weight)] > 1:
            return (
                f"{name}'s weight is tied to another (tie_word_embeddings): leave it out, or "
                "adapt the other linear layers"
            )
    return None


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def base_weights(model: nn.Module) -> set[str]:
    """The state-dict names of an adapted model's frozen weights (none without adapters):
    what its checkpoints leave out."""
    if not has_adapters(model):
        return set()
    named = model.named_parameters(remove_duplicate=False)  # a tied weight under each name
    return {name for name, p in named if not p.requires_grad}


@torch.no_grad()
def randomize_adapters(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Both adapter matrices drawn at random: with B zero, as training starts, A's gradients
    are zero and a check of them proves nothing. A as PEFT draws it (variance 1 / in), B such
    that the update (alpha / r) B A is no larger than a weight initialised with `std`: a
    larger one saturates attention's softmax, and the check would measure that instead."""
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            a, b = _weight(module.lora_A[ADAPTER_NAME]), _weight(module.lora_B[ADAPTER_NAME])
            scaling = module.scaling[ADAPTER_NAME]
            a.copy_(torch.randn(a.shape, generator=generator) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * std / scaling)


def _weight(linear: nn.Module) -> torch.Tensor:
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def adapter_state(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapters of a model's state, named as PEFT saves them (`adapter_model.safetensors`)."""
    return {
        SAVED_PREFIX + name.replace(f".{ADAPTER_NAME}.", "."): tensor.contiguous()
        for name, tensor in weights
        if is_adapter(name)
    }


def save_adapter(
    directory: Path, lora: LoraConfig, base: str | None, adapters: dict[str, torch.Tensor]
) -> None:
    """What `PeftModel.from_pretrained(base_model, directory)` loads."""
    directory.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base).save_pretrained(str(directory))
    save_file(adapters, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def merged_weights(
    weights: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state as the base model's, each adapted weight W + (alpha / r) B A (in fp32,
    then the weight's dtype), the adapters gone: a Hugging Face checkpoint of the base class.
    Streams: held back are only the parts of the linear layer being merged."""
    scaling = lora.alpha / lora.rank
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if BASE_PART in name:
            prefix, rest = name.split(BASE_PART, 1)
            if rest != "weight":  # the bias: as it is
                yield f"{prefix}.{rest}", tensor
                continue
            part = "weight"
        elif is_adapter(name):
            prefix, part = next((name.split(p, 1)[0], p) for p in ADAPTER_PARTS if p in name)
        else:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[prefix]
            base, a, b = parts["weight"], parts[".lora_A."], parts[".lora_B."]
            yield (
                f"{prefix}.weight",
                (base.float() + scaling * (b.float() @ a.float())).to(base.dtype),
            )
    assert not pending, f"adapted layers without all their parts: {sorted(pending)}"


def base_fingerprint(pretrained_path: str) -> str:
    """A short hash of the checkpoint at `pretrained_path`: its config.json, and of each weight
    file its name, its size and 16 samples of 64 KiB at even offsets. Another checkpoint (another
    fine-tune of the same architecture too) hashes differently; reading it costs ~1 MiB a file,
    not the model's size."""
    root = Path(pretrained_path).expanduser()
    digest = hashlib.sha256()
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = path.stat().st_size
        digest.update(json.dumps([path.name, size]).encode())
        with open(path, "rb") as f:
            for i in range(SAMPLES_PER_FILE):
                f.seek(max(size - SAMPLE_BYTES, 0) * i // max(SAMPLES_PER_FILE - 1, 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]
