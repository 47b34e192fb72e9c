"""prepare_sp_inputs shards a batch so that the shards' losses add up to the full-sequence loss."""

import pytest
import torch
from sp_cases import tiny_model
from torch._dynamo.testing import CompileCounter

from slurm_autosp.compile import AutoSPCompileError
from slurm_autosp.compile.hf_attention import use_sp_attention
from slurm_autosp.compile.layers import decoder_layers
from slurm_autosp.sp import IGNORE_INDEX, prepare_sp_inputs


def _shards(sp_size: int, **batch):
    return [prepare_sp_inputs(**batch, sp_rank=r, sp_size=sp_size) for r in range(sp_size)]


def test_labels_are_shifted_once_over_the_whole_sequence():
    ids = torch.arange(1, 9).unsqueeze(0)
    shards = _shards(2, input_ids=ids)
    labels = torch.cat([s.shift_labels for s in shards], dim=1)
    assert labels.tolist() == [[2, 3, 4, 5, 6, 7, 8, IGNORE_INDEX]]
    assert shards[0].shift_labels[0, -1] == 5, "the label pair crossing the shard boundary is kept"
    assert [s.valid_labels for s in shards] == [4, 3]


def test_sequence_not_divisible_by_sp_is_padded_with_ignored_labels_and_global_positions():
    ids = torch.arange(1, 128).unsqueeze(0)
    shards = _shards(2, input_ids=ids, pad_token_id=0)
    assert [s.input_ids.shape[1] for s in shards] == [64, 64]
    assert (
        shards[1].input_ids[0, -1] == 0
        and shards[1].shift_labels[0, -2:].tolist() == [IGNORE_INDEX] * 2
    )
    assert torch.cat([s.position_ids for s in shards], dim=1).tolist() == [list(range(128))]
    assert sum(s.valid_labels for s in shards) == 126


def test_right_padding_becomes_ignored_labels():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    shards = _shards(2, input_ids=ids, attention_mask=mask)
    labels = torch.cat([s.shift_labels for s in shards], dim=1)
    assert labels.tolist() == [[6, 7, 8] + [IGNORE_INDEX] * 3]
    assert "attention_mask" not in shards[0].model_kwargs(3)


def test_padding_between_tokens_is_refused_naming_the_rows():
    """Padding at either end of a row is exact without a mask (test_sliding_windows); a hole is not."""
    ids = torch.arange(1, 7).expand(2, 6)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\] has padding between tokens"):
        prepare_sp_inputs(ids, attention_mask=mask, sp_rank=0, sp_size=2)


def test_position_ids_that_jump_without_restarting_a_document_are_refused():
    ids = torch.arange(1, 9).unsqueeze(0)
    jumping = torch.tensor([[0, 1, 2, 7, 8, 9, 10, 11]])
    with pytest.raises(ValueError, match="restart at row 0, token 3 with position 7, not 0"):
        prepare_sp_inputs(ids, position_ids=jumping, sp_rank=0, sp_size=2)


def test_count_goes_to_the_model_as_a_tensor_so_graphs_do_not_specialise_on_it():
    shard = prepare_sp_inputs(torch.arange(1, 9).unsqueeze(0), sp_rank=0, sp_size=2)
    kwargs = shard.model_kwargs(7)
    assert torch.is_tensor(kwargs["num_items_in_batch"]) and kwargs["use_cache"] is False


def test_a_new_document_count_or_longest_document_does_not_compile_the_layers_again():
    """Packed rows' document count and longest document change from batch to batch; the
    compiled layers get the lengths' tensor itself, symbolic in that count from the first step
    (before, every job compiled its layers twice: static at step 1, again with a symbolic count
    at step 2), and the longest document as the length of an empty tensor, symbolic too (as a
    plain int it would compile them again at step 2)."""
    model = tiny_model("llama", 2)
    use_sp_attention(model)
    counter = CompileCounter()
    for layer in decoder_layers(model):
        layer.compile(backend=counter)
    ids = torch.randint(1, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    for lengths in ([30, 18], [10, 20, 18], [5, 5, 5, 33]):
        documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        shard = prepare_sp_inputs(ids, document_ids=documents[None], sp_rank=0, sp_size=1)
        assert shard.cu_seqlens.numel() == len(lengths) + 1
        kwargs = shard.model_kwargs(shard.valid_labels)
        assert kwargs["max_length_q"].shape == (max(lengths), 0) == kwargs["max_length_k"].shape
        model(**kwargs).loss.backward()
    assert counter.frame_count == 1, f"the layers compiled {counter.frame_count} times"


def test_the_longest_document_is_read_on_the_host_once_per_batch_and_spans_the_padding():
    """The CUDA kernel needs the longest document's length; prepare_sp_inputs reads it once per
    micro-batch. Padding to the SP size joins each row's last document."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]])
    shards = _shards(2, input_ids=torch.arange(1, 8).expand(2, 7), position_ids=positions)
    assert shards[0].cu_seqlens.tolist() == [0, 3, 5, 8, 12, 16]
    assert [s.longest_document for s in shards] == [4, 4]
    assert prepare_sp_inputs(torch.arange(1, 9)[None], sp_rank=0, sp_size=2).longest_document == 0


def test_a_longest_document_given_as_an_int_is_refused_naming_model_kwargs():
    """HF's own convention for max_length_q, an int, would compile the layers again at the
    second batch; the attention refuses it and says what to pass."""
    model = tiny_model("llama", 2)
    use_sp_attention(model)
    documents = torch.repeat_interleave(torch.arange(2), torch.tensor([30, 18]))[None]
    shard = prepare_sp_inputs(
        torch.arange(1, 49)[None], document_ids=documents, sp_rank=0, sp_size=1
    )
    kwargs = shard.model_kwargs(shard.valid_labels)
    kwargs["max_length_q"] = kwargs["max_length_k"] = 30
    with pytest.raises(
        AutoSPCompileError, match=r"max_length_q=30; .* empty \[longest, 0\] tensor"
    ):
        model(**kwargs)
