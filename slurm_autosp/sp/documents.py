"""Where documents start in packed rows, from either convention a batch may carry.

Hugging Face's packed convention (`DataCollatorWithFlattening`): position ids that restart at 0
where a document starts. The explicit one: a document id per token, constant over each
document. Both become one [B, S] boolean tensor, True at each document's first token; from it
come the per-document positions (RoPE restarts), the labels that would cross a boundary, and
the cumulative document lengths the attention reads. Left padding is a document of its own
(`first_valid_tokens` starts the row's first real one): no real token attends to it. Inputs that
do not describe contiguous documents are refused: a wrong guess would mix documents silently.
"""

import torch


class PackedRowsError(ValueError):
    """Position ids or document ids that do not describe documents laid end to end."""


def _first(where: torch.Tensor) -> str:
    row, token = (int(i) for i in where.nonzero()[0])
    return f"row {row}, token {token}"


def first_valid_tokens(valid: torch.Tensor) -> torch.Tensor:
    """True at the first token of each row's run of `valid` tokens (after any left padding)."""
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    return valid & ~before


def starts_from_document_ids(document_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """True where `document_ids` [B, S] change between `valid` tokens, at each row's first token
    and at its first valid one; ids must not decrease along a row, so each document is one
    contiguous run (an id that comes back would be a document in two pieces)."""
    steps = (document_ids[:, 1:] - document_ids[:, :-1]).masked_fill(
        ~(valid[:, 1:] & valid[:, :-1]), 0
    )
    if bool((steps < 0).any()):
        at = _first(steps < 0)
        raise PackedRowsError(
            f"document_ids decrease along a row ({at} + 1): each document must be one contiguous "
            "run of tokens with ids increasing along the row (number the documents 0, 1, 2, ...)"
        )
    first = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    return torch.cat([first, steps != 0], dim=1) | first_valid_tokens(valid)


def starts_from_position_ids(position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """True where `position_ids` [B, S] do not step by one between `valid` tokens (a document
    starts), at each row's first token and at its first valid one; padding starts nothing else.
    In a row of several documents each must start at position 0, as `DataCollatorWithFlattening`
    writes them."""
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    restarts = (steps != 1) & valid[:, 1:] & valid[:, :-1]
    first = torch.ones_like(restarts[:, :1])
    starts = torch.cat([first, restarts], dim=1) | first_valid_tokens(valid)
    packed_rows = restarts.any(dim=1, keepdim=True)
    wrong = starts & valid & packed_rows & (position_ids != 0)
    if bool(wrong.any()):
        row, token = (int(i) for i in wrong.nonzero()[0])
        raise PackedRowsError(
            f"position_ids restart at row {row}, token {token} with position "
            f"{int(position_ids[row, token])}, not 0: in a packed row (several documents) every "
            "document's positions must run 0, 1, 2, ... (as DataCollatorWithFlattening writes them); "
            "pass document_ids instead, or one sequence per row"
        )
    return starts


def positions_within(starts: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document: RoPE restarts where a document does."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    last_start = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return index - last_start


def cumulative_lengths(starts: torch.Tensor, padded_len: int) -> torch.Tensor:
    """cu_seqlens (int32) of the rows laid end to end, each row padded to `padded_len` tokens
    (the padding joins the row's last document: it comes after every token, so it changes
    nothing causal attention computes for them)."""
    batch, seq = starts.shape
    padded = torch.nn.functional.pad(starts, (0, padded_len - seq), value=False)
    first_tokens = padded.flatten().nonzero().flatten()
    total = torch.tensor([batch * padded_len], device=starts.device)
    return torch.cat([first_tokens, total]).to(torch.int32)
