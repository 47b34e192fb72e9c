"""Which sequence-parallel sizes an attention head layout allows.

Ulysses splits attention heads over the SP ranks: the query heads must divide by the SP
size, and the key/value heads must either divide by it (split directly) or divide it (each
KV head repeated to one per rank). Kept free of heavy imports: config validation uses it,
and so do the error messages of config, topology and layout that list the sizes to choose.
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
