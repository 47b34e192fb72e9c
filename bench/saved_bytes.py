"""What a Hugging Face causal LM's decoder layers save for backward, counted per step: the
storages packed by autograd between the embedding and the final norm, less the parameters and
the rotary cos/sin every layer shares. Shared by the benches that report saved bytes."""

from __future__ import annotations

import torch


class DecoderSavedBytes:
    """Hooks `model` once; `counting()` wraps a forward, `clear()` starts a new step.

    The embedding and the final norm run eagerly (not compiled), so hooks on them fire in order
    around the decoder layers. A counted storage is held until `clear()`, so a freed one's
    address cannot come back as another within a step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._inside = False
        self._shared: set[int] = set()
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.shapes: list[tuple[int, ...]] = []
        inner = model.model
        inner.embed_tokens.register_forward_hook(lambda *_: self._set_inside(True))
        inner.norm.register_forward_pre_hook(lambda *_: self._set_inside(False))
        inner.rotary_emb.register_forward_hook(
            lambda _m, _a, out: self._shared.update(t.untyped_storage().data_ptr() for t in out)
        )

    def _set_inside(self, inside: bool) -> None:
        self._inside = inside

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._inside:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in self._params and ptr not in self._shared:
                self.storages[ptr] = tensor.untyped_storage()
                self.shapes.append(tuple(tensor.shape))
        return tensor

    def counting(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that count (the innermost hooks apply: an offload's replace them)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def clear(self) -> None:
        self.storages.clear()
        self.shapes.clear()

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())
