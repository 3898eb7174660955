"""Content keys of cached KV blocks: a hash chain that starts from the request's namespace.

A block's key is `H(parent key, the block's token ids)`; the first block's parent is the root,
`H(typed namespace)`. The namespace holds what makes the same tokens' KV differ or must not be
shared: the weights (the base model, or one loaded adapter version's identity: never its name,
which a reload or version swap reuses) and the operator's sharing salt (a listener's, or a
trusted identity's; never a field the client alone chooses). Both are encoded with their types
and lengths (a pickled tuple), so no adapter identity, salt or tenant can be spelled as another;
the chain's parts are fixed-width (a 32-byte parent, 8-byte tokens), so no two chains meet.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from dataclasses import dataclass

from inference_service.engine.request import CacheSalt, Request

KEY_VERSION = "loraplex.prefix.v1"


@dataclass(frozen=True)
class CacheNamespace:
    """Who may share a cached block: same weights and same salt."""

    weights: tuple[str, ...]  # ("base",) or ("lora", uid, digest or load identity)
    salt: CacheSalt | None = None  # the front end's (frontend/cache_salt.py); None: shared per weights

    def root(self) -> bytes:
        encoded = pickle.dumps((KEY_VERSION, self.weights, self.salt), protocol=5)
        return hashlib.sha256(encoded).digest()


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def extend_hashes(request: Request, root: bytes, block_size: int, num_tokens: int) -> list[bytes]:
    """The request's block keys for its first `num_tokens // block_size` full blocks (computed once
    each and kept on the request; recomputed from scratch when its namespace changed)."""
    if request.cache_root != root:
        request.cache_root, request.block_hashes, request.keyed_blocks = root, [], 0
    hashes = request.block_hashes
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(chain_hash(parent, request.token_ids(i * block_size, (i + 1) * block_size)))
    return hashes
