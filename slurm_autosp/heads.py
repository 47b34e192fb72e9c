"""Which sequence-parallel sizes an attention head layout allows.

Ulysses splits attention heads over the SP ranks: the query heads must divide by the SP
size, and the key/value heads must either divide by it (split directly) or divide it (each
KV head repeated to one per rank). Past the head count an SP size splits into Ulysses x ring
(`parallel.ring_size`): only the Ulysses size meets the heads. Kept free of heavy imports:
config validation uses it, and so do the error messages of config, topology and layout that
list the sizes to choose.
"""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choices_text(choices: list[int]) -> str:
    """ "1, 2, 4 or 8": the sizes an error message offers."""
    if len(choices) == 1:
        return str(choices[0])
    return ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"


def valid_sp_sizes(query_heads: int, kv_heads: int) -> list[int]:
    return [
        p
        for p in range(1, query_heads + 1)
        if query_heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)
    ]


def grouped_on_each_rank(query_heads: int, kv_heads: int, ulysses: int) -> bool:
    """Whether each of `ulysses` ranks still holds fewer key/value heads than query heads once
    the heads are split (a KV head repeated to one per rank where there are fewer than ranks)."""
    kv_repeat = max(1, ulysses // kv_heads)
    return query_heads // ulysses != kv_heads * kv_repeat // ulysses


def ulysses_ring_pairs(
    sp_size: int, query_heads: int | None, kv_heads: int | None
) -> list[tuple[int, int]]:
    """(ulysses, ring) sizes whose product is `sp_size` and whose Ulysses size the heads allow
    (any divisor when the heads are unknown, e.g. a pretrained checkpoint's): ring attention
    passes whole key/value blocks between ranks, so only the Ulysses size meets the heads."""
    allowed = divisors(sp_size)
    if query_heads and kv_heads:
        allowed = [u for u in allowed if u in valid_sp_sizes(query_heads, kv_heads)]
    return [(u, sp_size // u) for u in allowed]


def pairs_text(pairs: list[tuple[int, int]]) -> str:
    """ "8 x 1 (parallel.ring_size=1), 4 x 2 (parallel.ring_size=2)": the splits an error offers."""
    return ", ".join(f"{u} x {r} (parallel.ring_size={r})" for u, r in sorted(pairs, reverse=True))


def auto_ring_size(
    sp_size: int,
    domain: int,
    query_heads: int | None,
    kv_heads: int | None,
    allow_cross_domain: bool = False,
) -> int:
    """The ring size `parallel.ring_size` null resolves to: the Ulysses size as large as the
    heads allow and `domain` (the GPUs every NVLink domain holds a whole number of groups of)
    holds, the ring over the rest, so only ring attention's point-to-point block exchange
    crosses domains. With `allow_cross_domain` a Ulysses size the heads allow whole stays
    Ulysses alone (ring 1), as the user asked for all-to-all across domains."""
    pairs = ulysses_ring_pairs(sp_size, query_heads, kv_heads)
    if allow_cross_domain and (sp_size, 1) in pairs:
        return 1
    return min(r for u, r in pairs if domain % u == 0)  # Ulysses 1 always fits
