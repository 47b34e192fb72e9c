"""Which sequence-parallel sizes an attention head layout allows.

Ulysses splits attention heads over the SP ranks: the query heads must divide by the SP
size, and the key/value heads must either divide by it (split directly) or divide it (each
KV head repeated to one per rank). Kept free of heavy imports: config validation uses it.
"""


def valid_sp_sizes(query_heads: int, kv_heads: int) -> list[int]:
    return [
        p
        for p in range(1, query_heads + 1)
        if query_heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)
    ]
