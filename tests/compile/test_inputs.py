"""prepare_sp_inputs shards a batch so that the shards' losses add up to the full-sequence loss."""

import pytest
import torch

from slurm_autosp.compile import IGNORE_INDEX, prepare_sp_inputs


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
