"""Token sequences: how much of a prompt a slot, a stored state or another request already holds.

llama-server reuses a slot's KV cache for the longest common token prefix of what the slot holds
and the new prompt, so that prefix is the only honest measure of what is cached: two requests that
differ inside one message still share everything before the first differing token. Pure.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["Tokens", "common_prefix", "digest"]

#: Token ids as stored in the slot table and the prefix store: immutable and compact.
Tokens = tuple[int, ...]


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (token ids, or two texts).

    A binary search over slice comparisons: each comparison runs in C, so a 12,000-token prompt
    costs a few dozen of them instead of 12,000 Python-level steps.
    """
    if type(a) is not type(b):  # a tuple never equals a list, whatever they hold
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def digest(tokens: Sequence[int]) -> str:
    """A short stable hash of a token sequence (for file names, the index and logs)."""
    return hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:24]
