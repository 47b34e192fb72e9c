"""Sliding-window attention (on every layer, or on some as the HF config says) and left padding
under sequence parallelism equal the unmodified HF model on one device with its own mask.

The window is applied by `document_attention` within each document: a window shorter than a
document runs in query chunks under a chunk-sized mask, never S x S. Left padding is a document
of its own that no real token attends to, and nothing predicts from a pad."""

import pytest
import torch
import torch.nn.functional as F
from document_cases import PackedCase, packed_sp_step
from sp_cases import Case, sp_step, tiny_model
from test_packed_documents import ROWS_96
from test_sp_equivalence import assert_matches_reference

import slurm_autosp.sp.document_attention as document_module
from slurm_autosp.compile.hf_attention import use_sp_attention
from slurm_autosp.sp import IGNORE_INDEX, prepare_sp_inputs
from slurm_autosp.sp.attention_pattern import UnsupportedAttention, layer_window
from slurm_autosp.sp.document_attention import DocumentAttentionError, document_attention

TOLERANCE = 1e-5


# ------------------------------------------------------------------ the op (no processes)


def _qkv(seq: int = 40) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(2, 4, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8)]
    return [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _dense_reference(query, key, value, cu_seqlens, window, scale):
    """SDPA under the whole [S, S] mask: same document, k <= q, q - k < window."""
    batch, _, seq, _ = query.shape
    document = torch.zeros(batch * seq, dtype=torch.long)
    for bound in cu_seqlens.tolist()[1:-1]:
        document[bound:] += 1
    document = document.view(batch, seq)
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None]
    allowed = (document[:, :, None] == document[:, None, :]) & (k <= q) & (q - k < window)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    )


@pytest.mark.parametrize("window", [3, 7, 16, 40])
@pytest.mark.parametrize(
    "chunks", [(64, 512), (1, 4)], ids=["chunks_as_configured", "chunks_shorter_than_windows"]
)
def test_windowed_document_attention_equals_sdpa_under_the_whole_mask(monkeypatch, window, chunks):
    """Documents shorter and longer than the window, one of a single token, rows without
    boundaries; query chunks longer and shorter than the window: forward and every gradient."""
    monkeypatch.setattr(document_module, "_MIN_CHUNK", chunks[0])
    monkeypatch.setattr(document_module, "_MAX_CHUNK", chunks[1])
    for cu_seqlens in ([0, 5, 6, 33, 40, 47, 80], None):
        query, key, value = _qkv()
        bounds = torch.tensor(cu_seqlens or [0, 40, 80], dtype=torch.int32)
        given = None if cu_seqlens is None else bounds
        output, _ = document_attention(query, key, value, given, 0.3, window)
        expected = _dense_reference(query, key, value, bounds, window, 0.3)
        grad = torch.randn_like(output)
        got = torch.autograd.grad(output, (query, key, value), grad)
        want = torch.autograd.grad(expected, (query, key, value), grad)
        assert torch.allclose(output, expected, atol=1e-12, rtol=0)
        assert all(torch.allclose(g, w, atol=1e-12, rtol=0) for g, w in zip(got, want, strict=True))


def test_a_negative_window_is_refused():
    with pytest.raises(DocumentAttentionError, match="window=-1"):
        document_attention(*_qkv(), None, 0.3, -1)


# ------------------------------------------------------------------ the model on one process


def _left_padded_batch(seq: int = 40) -> dict[str, torch.Tensor]:
    """Two rows, 6 and 3 pads on the left; no label is predicted from a pad."""
    input_ids = torch.randint(1, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    mask[0, :6], mask[1, :3] = 0, 0
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[0, 6], labels[1, 3] = IGNORE_INDEX, IGNORE_INDEX
    return {
        "input_ids": input_ids.masked_fill(mask == 0, 0),
        "labels": labels,
        "attention_mask": mask,
    }


@pytest.mark.parametrize(
    ("family", "window", "padded"),
    [
        ("mistral", 8, False),
        ("mistral", 40, False),
        ("mistral", 8, True),
        ("qwen2", 5, True),
        ("llama", None, True),
    ],
    ids=[
        "mistral_window",
        "mistral_window_covering_the_sequence",
        "mistral_window_left_padding",
        "qwen2_window_on_layer_1",
        "llama_left_padding",
    ],
)
def test_sp_attention_on_one_process_equals_the_model_with_its_own_mask(family, window, padded):
    """The model switched to SP attention, fed by prepare_sp_inputs (sp_size=1, eager), against
    the unmodified model given the attention mask: loss and every gradient, fp32."""
    batch = _left_padded_batch()
    if not padded:
        batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    reference = tiny_model(family, 2, window=window)
    loss = reference(**batch, use_cache=False).loss
    loss.backward()
    model = tiny_model(family, 2, window=window)
    use_sp_attention(model)
    shard = prepare_sp_inputs(**batch, sp_rank=0, sp_size=1)
    assert (shard.cu_seqlens is not None) == padded, "left padding is a document of its own"
    sp_loss = model(**shard.model_kwargs(shard.valid_labels)).loss
    sp_loss.backward()
    assert abs(float(sp_loss - loss)) <= TOLERANCE * abs(float(loss))
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        error = float((param.grad - ref.grad).abs().max() / ref.grad.abs().max())
        assert error <= TOLERANCE, f"{name}: {error}"


def test_left_padding_is_a_document_whose_labels_are_ignored():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    shards = [prepare_sp_inputs(ids, attention_mask=mask, sp_rank=r, sp_size=2) for r in (0, 1)]
    labels = torch.cat([s.shift_labels for s in shards], dim=1)
    ignored = IGNORE_INDEX
    assert labels.tolist() == [[ignored, ignored, 6, 7, 8, ignored], [6, 7, 8, 9, 10, ignored]]
    assert shards[0].cu_seqlens.tolist() == [0, 2, 6, 12]
    positions = torch.cat([s.position_ids for s in shards], dim=1)
    assert positions.tolist() == [list(range(6))] * 2, "Hugging Face's default positions"


def test_a_layer_passing_a_window_its_config_does_not_give_is_refused():
    windowed = tiny_model("mistral", 2, window=5).model.layers[0].self_attn
    assert layer_window(windowed, {"sliding_window": 5}) == 5
    with pytest.raises(UnsupportedAttention, match="passes sliding_window=None"):
        layer_window(windowed, {})  # every layer is windowed: the mask alone would window it
    some = tiny_model("qwen2", 2, window=5).model.layers[0].self_attn
    assert layer_window(some, {}) is None and layer_window(some, {"sliding_window": 5}) == 5
    with pytest.raises(UnsupportedAttention, match="passes sliding_window=7"):
        layer_window(some, {"sliding_window": 7})


# ------------------------------------------------------------------ SP=2 against one device


@pytest.mark.slow
def test_sp2_window_on_every_layer_across_the_shard_boundary_with_left_padding(pool2):
    """Mistral's 12-token window over 95 tokens (shards of 48: the windows of shard 1's first
    queries reach into shard 0), rows left-padded by 7 and 14, uneven ignored labels."""
    case = Case(
        family="mistral", window=12, seq=95, left_padding=True, labels="uneven", per_layer=True
    )
    assert_matches_reference(pool2.run(sp_step, case, 2))


@pytest.mark.slow
def test_sp2_window_on_some_layers_within_packed_documents_matches_each_document_alone(pool2):
    """Qwen2's window on layer 1 only (max_window_layers=1), within documents that span the shard
    boundary, are shorter than the window, or are a single token."""
    case = PackedCase(ROWS_96, family="qwen2", window=12, per_layer=True)
    assert_matches_reference(pool2.run(packed_sp_step, case, 2))
