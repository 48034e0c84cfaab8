"""Block hashes for prefix caching: a chain over (parent hash, block tokens, salt).

The salt keeps tenants apart: two tenants with the same prompt get different hashes unless they
share a cache group, so one cannot learn another's prompts by timing cache hits.
"""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent: bytes, tokens: list[int], salt: str) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    digest.update(salt.encode("utf-8"))
    return digest.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, salt: str,
                        num_blocks: int) -> list[bytes]:
    """Grow `hashes` (in place) to cover the first num_blocks full blocks of token_ids."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    for index in range(len(hashes), num_blocks):
        parent = hashes[index - 1] if index else b""
        hashes.append(hash_block(parent, token_ids[index * block_size:(index + 1) * block_size], salt))
    return hashes


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int, salt: str) -> tuple[bytes, ...]:
    """The chain of the prompt's full blocks: what `extend_block_hashes` would compute for them."""
    return tuple(extend_block_hashes([], prompt_token_ids, block_size, salt, len(prompt_token_ids) // block_size))
