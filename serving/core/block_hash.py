"""vLLM's prefix-cache block hash (its `sha256_cbor` algorithm, as its KV events publish it with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), for the KV-event stream's `--kv_events_block_hash=vllm` option: a router that
computes vLLM's hashes from the prompt's token ids (llm-d's precise-prefix-cache scorer) can then look up what a
meshserve instance holds. Details: docs/engine.md ("KV events")."""
from __future__ import annotations

import hashlib
import os
from typing import Callable, Sequence

DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of the first block's parent hash when PYTHONHASHSEED is unset

BlockHasher = Callable[[bytes | None, Sequence[int], tuple | None], bytes]


def sha256_cbor(value) -> bytes:
    """SHA-256 of `value`'s canonical CBOR encoding (cbor2, imported only for this option)."""
    import cbor2
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def vllm_block_hasher(seed: str | None = None) -> BlockHasher:
    """hash(parent hash, block token ids, extra keys) -> 32 bytes, chained like vLLM's hash_block_tokens: the first
    block's parent is sha256_cbor(seed) (seed: `seed`, else $PYTHONHASHSEED, else vLLM's default)."""
    seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    none_hash = sha256_cbor(seed)

    def block_hash(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
        return sha256_cbor((parent or none_hash, tuple(token_ids), extra_keys))
    return block_hash


def external_hash(digest: bytes) -> int:
    """The 64-bit integer vLLM's events carry for a block hash (its low 8 bytes, big-endian)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)
