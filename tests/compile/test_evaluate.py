"""Held-out evaluation under SP equals the single-device eval loss: the AutoSP-compiled model
run without grad after a training step, MLPs tiled or not, samples split over DP ranks with a
last round that leaves some ranks without a sample. Rank-side code is in train_cases.py."""

import pytest
import torch
from sp_cases import VOCAB
from train_cases import EVAL_SEQ, held_out_eval

from slurm_autosp.data import write_token_file

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eval") / "eval.tokens"
    ids = torch.randint(1, VOCAB, (6 * EVAL_SEQ,), generator=torch.Generator().manual_seed(3))
    write_token_file(path, ids.numpy(), vocab_size=VOCAB)
    return str(path)


@pytest.mark.slow  # the fast tier keeps one training equivalence case per engine
@pytest.mark.parametrize(
    ("sp_size", "tile_tokens"), [(2, 0), (1, 0), (2, 16)], ids=["sp2", "dp2", "sp2_tiled"]
)
def test_sp_eval_loss_equals_single_device_eval_loss(pool2, held_out, sp_size, tile_tokens):
    """5 samples, micro-batches of 2: the last round is one sample and padding (no labels)."""
    result = pool2.run(held_out_eval, held_out, sp_size, tile_tokens, 2, 5)[0]
    assert result["tokens"] == result["ref_tokens"], result
    assert result["rel_error"] <= TOLERANCE, result
    assert result["still_training"], result


@pytest.mark.slow
def test_eval_over_a_ring_equals_single_device_eval_loss(pool2, held_out):
    """SP=2 as a ring of 2: evaluation shards each round in zigzag order (dims.ring_size)."""
    result = pool2.run(held_out_eval, held_out, 2, 0, 2, 5, 2)[0]
    assert result["tokens"] == result["ref_tokens"], result
    assert result["rel_error"] <= TOLERANCE, result
