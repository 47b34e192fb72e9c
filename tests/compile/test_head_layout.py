"""Heads split over SP ranks keep grouped-query attention's query-to-KV-head mapping."""

import pytest
import torch

from slurm_autosp.compile import AutoSPCompileError
from slurm_autosp.compile.backend import HeadLayout
from slurm_autosp.heads import valid_sp_sizes

LAYOUTS = [
    (4, 4, 2),
    (4, 2, 2),
    (8, 2, 4),
    (4, 2, 4),
    (4, 1, 2),
    (4, 1, 4),
    (8, 2, 8),
    (32, 8, 16),
    (64, 8, 8),
]


@pytest.mark.parametrize("query_heads,kv_heads,sp_size", LAYOUTS)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(query_heads, kv_heads, sp_size):
    layout = HeadLayout(query_heads, kv_heads, sp_size)
    kv_of_query = torch.arange(query_heads) // (query_heads // kv_heads)
    kv_sent = torch.arange(kv_heads).repeat_interleave(layout.kv_repeat)
    for local_q, local_kv in zip(
        torch.arange(query_heads).chunk(sp_size), kv_sent.chunk(sp_size), strict=True
    ):
        group = len(local_q) // len(local_kv)
        assert layout.local_grouped == (group > 1)
        assert torch.equal(local_kv[torch.arange(len(local_q)) // group], kv_of_query[local_q])


@pytest.mark.parametrize("query_heads,kv_heads,sp_size", LAYOUTS)
def test_kv_heads_are_repeated_only_up_to_the_sp_size(query_heads, kv_heads, sp_size):
    assert kv_heads * HeadLayout(query_heads, kv_heads, sp_size).kv_repeat == max(kv_heads, sp_size)


def test_unsplittable_heads_name_the_counts_and_the_valid_sp_sizes():
    with pytest.raises(
        AutoSPCompileError, match=r"6 query heads and 3 key/value heads.*sp_size=2.*\[1, 3, 6\]"
    ):
        HeadLayout(6, 3, 2)
    assert valid_sp_sizes(32, 8) == [1, 2, 4, 8, 16, 32]
