"""Sequence tiling (`compile_model(..., tile_tokens=N)`: `tile_mlps`, and under `full`
`tile_layers`) trains exactly as untiled, single-device, under AutoSP and through both engines,
while no tensor of the MLP's width spans more than one tile. Rank-side code is in
tiling_cases.py."""

import pytest
import torch
from sp_cases import Case
from test_sp_equivalence import assert_matches_reference
from tiling_cases import engine_tiled_vs_untiled, tiled_sp_step
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from slurm_autosp.compile import AutoSPCompileError, compile_model, tile_mlps
from slurm_autosp.compile.tiled_layer import tile_layers

TOLERANCE = 1e-5
HIDDEN, INTERMEDIATE = 32, 256  # an MLP 8x as wide as the hidden states, so its tensors stand out
BATCH, SEQ = 2, 50
SP_TILE = 24  # an SP=2 shard of 127 tokens is 64: tiles of 24 + 24 + 16


def wide_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def input_ids() -> torch.Tensor:
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = input_ids()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


TILERS = pytest.mark.parametrize("tiler", [tile_mlps, tile_layers], ids=["mlps", "whole_layers"])


@TILERS
@pytest.mark.parametrize(
    "tile", [16, 64], ids=["seq_50_in_tiles_of_16", "tile_64_longer_than_seq_50"]
)
def test_tiled_loss_and_every_gradient_equal_untiled(tile, tiler):
    ref_loss, ref_grads = loss_and_grads(wide_llama())
    model = wide_llama()
    tiler(model, tile)
    loss, grads = loss_and_grads(model)
    assert grads.keys() == ref_grads.keys(), "tiling renamed parameters"
    assert float((loss - ref_loss).abs() / ref_loss.abs()) <= TOLERANCE
    errors = {
        name: float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max())
        for name, g in grads.items()
    }
    assert max(errors.values()) <= TOLERANCE, errors


def _mlp_width_tokens(tensor: torch.Tensor) -> int:
    """Tokens a tensor of the MLP's width spans (numel / intermediate); 0 for other tensors and
    for the MLP's weights and their gradients."""
    if INTERMEDIATE not in tensor.shape or tuple(tensor.shape) in {
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    }:
        return 0
    return tensor.numel() // INTERMEDIATE


class _WidestMLPTensors(TorchDispatchMode):
    """The most tokens any tensor of the MLP's width spans, over every op's output."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.tokens = max([self.tokens, *map(_mlp_width_tokens, tensors)])
        return out


def widest_mlp_tensors(tile: int, tiler=tile_mlps) -> tuple[int, int]:
    """Over a forward and backward (the tiles' recompute included): the most tokens a tensor of
    the MLP's width spans, among all tensors created and among those saved for backward."""
    model = wide_llama()
    if tile:
        tiler(model, tile)
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(_mlp_width_tokens(tensor))
        return tensor

    with (
        _WidestMLPTensors() as created,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss_and_grads(model)
    return created.tokens, max(saved)


def test_no_tensor_of_the_mlp_width_spans_more_than_one_tile():
    assert widest_mlp_tensors(0) == (BATCH * SEQ, BATCH * SEQ), (
        "the untiled MLP's width was not detected"
    )
    assert widest_mlp_tensors(16) == (BATCH * 16, BATCH * 16)
    assert widest_mlp_tensors(16, tile_layers) == (BATCH * 16, BATCH * 16)


def _forward_saves(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shapes of the non-parameter tensors a forward saves for backward, in order."""
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ids = input_ids()
        model(input_ids=ids, labels=ids, use_cache=False)
    return shapes


def test_a_tiled_layer_keeps_only_its_input_for_backward():
    """Between the embedding's saved ids and what the final norm, lm_head and loss save (as
    untiled), each of the two tiled layers keeps one [batch, sequence, hidden] tensor."""
    untiled = _forward_saves(wide_llama())
    model = wide_llama()
    tile_layers(model, 16)
    tiled = _forward_saves(model)
    tail = tiled[3:]
    assert tiled[:3] == [(BATCH, SEQ), (BATCH, SEQ, HIDDEN), (BATCH, SEQ, HIDDEN)], tiled
    assert untiled[0] == (BATCH, SEQ) and untiled[-len(tail) :] == tail, (untiled, tiled)


def test_one_graph_pair_serves_every_tiled_layer():
    """Per-layer compilation breaks each layer's graph around the tiled MLP: two graphs (before
    and after it) for all three layers, none compiled again on the next step."""
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()  # a full cache for the layer's code would fall back to eager: no graphs
    model = wide_llama(layers=3)
    compile_model(model, counting_backend, per_layer=True, tile_tokens=16)
    for _ in range(2):
        loss_and_grads(model)
    assert len(graphs) == 2, [gm.code for gm in graphs]


def test_tile_mlps_refuses_layers_without_an_mlp_and_tiles_under_one_token():
    model = wide_llama()
    with pytest.raises(ValueError, match="tile_tokens must be >= 1"):
        tile_mlps(model, 0)
    for layer in model.model.layers:
        del layer.mlp
    with pytest.raises(
        AutoSPCompileError, match=r"decoder layers \['LlamaDecoderLayer'\] have no `mlp` submodule"
    ):
        tile_mlps(model, 8)


def assert_tiled_matches_reference(results: list[dict]) -> None:
    assert all(r["tiled"] == [2] for r in results), (
        f"the SP model's MLPs or layers were not all tiled: {results}"
    )
    assert_matches_reference(results)


WHAT = pytest.mark.parametrize("whole_layers", [False, True], ids=["mlps", "whole_layers"])


@pytest.mark.slow
@WHAT
def test_sp2_tiled_matches_single_device(pool2, whole_layers):
    """One sequence, as in the engine tests below: they reuse this test's compiled graphs."""
    case = Case(batch=1, seq=127, labels="uneven", per_layer=True)
    assert_tiled_matches_reference(pool2.run(tiled_sp_step, case, 2, SP_TILE, whole_layers))


@pytest.mark.slow
def test_sp2_as_ring_2_tiled_layers_match_single_device_and_never_rerun_the_ring(pool2):
    """Tiled whole layers (full checkpointing) under a ring, SP=2 as 1 x 2: attention is ring
    attention over the ring's blocks, its output and log-sum-exp kept from the forward for the
    backward, which recomputes q, k, v tile by tile but never the ring."""
    case = Case(batch=1, seq=127, labels="uneven", per_layer=True)
    results = pool2.run(tiled_sp_step, case, 2, SP_TILE, True, 2)
    assert_tiled_matches_reference(results)
    assert all(r["ring_forwards_in_backward"] == 0 for r in results), results
    assert all(r["ring_backwards"] == 2 for r in results), results  # one per layer


@pytest.mark.slow
def test_sp2_tiled_qwen2_layers_of_a_batch_of_two_with_one_kv_head_match_single_device(pool2):
    """Qwen2's q, k, v projections have biases; its one KV head is repeated to both SP ranks
    (the tiled layer's own all-to-alls, and the sum of the copies' gradients in backward). Two
    sequences per rank: the tiles are slices of a batch. (Tiled MLPs of a batch of two:
    test_local_run's tiled run. Data parallelism adds nothing a rank's tiles see: its gradient
    reduction is the engines', tested tiled below.)"""
    case = Case(family="qwen2", kv_heads=1, batch=2, seq=127, labels="uneven", per_layer=True)
    assert_tiled_matches_reference(pool2.run(tiled_sp_step, case, 2, SP_TILE, True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero_stage, whole_layers",
    [(1, False), (3, False), (3, True)],
    ids=["deepspeed_zero1-mlps", "fsdp2-mlps", "fsdp2-whole_layers"],
)
def test_sp2_optimizer_steps_tiled_equal_untiled(pool2, zero_stage, whole_layers):
    """Two steps of two micro-batches each: the tiles' gradients accumulate into .grad where
    the engine expects them, so the losses (the second step's is the updated weights'), the
    gradients and their norms are the untiled ones. Whole layers under FSDP2, which shards
    each decoder layer, the unit tiled (under ZeRO-1, tiled layers' gradients accumulate into
    .grad as tiled MLPs' do). The weights are held to the bound that
    train_cases holds them to against one device: AdamW's first steps move a weight by about
    lr * g / (|g| + eps), so where |g| is near eps (1e-8) float rounding of g moves it visibly."""
    result = pool2.run(engine_tiled_vs_untiled, zero_stage, 2, SP_TILE, 2, whole_layers)[0]
    assert result["same_initial_weights"] and result["tiled"] == (0, 2), result
    for key in ("loss_rel_error", "grad_norm_rel_error", "grad_rel_error"):
        assert result[key] <= TOLERANCE, (key, result)
    assert result["weight_rel_error"] <= 1e-2, result
