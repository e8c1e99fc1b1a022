"""Automatic prefix caching: a replica's full KV blocks of prompts, found again
by their content.

A block of `block_rows` prompt rows is named by a hash chained over the
tokens of every block up to and including it, seeded with what else decides
its rows' values: the model (its directory and revision), the cache's dtype
and the request's `cache_salt`. Two sessions whose prompts agree on their
first n full blocks (same model, dtype and salt) therefore name those blocks
alike, and a new session's prefill starts after the longest run of blocks
already cached: the session takes them (a reference each) instead of
computing them. A block's name covers its whole prefix, so a hit on block i
implies blocks 0..i-1 are the same rows too.

Rules that keep output exact:
- only full blocks of prompt rows are named, and a named block is never
  written again: the session that computed it and every session that shares
  it write only rows past their prompt (drafts, tree rows, compaction and
  rollback stay in their own blocks; LeanSession checks it). When a verifier
  session ends, the full blocks of the rows it committed (prompt and
  generated tokens, no draft row) are named too: it writes nothing more, and
  chat clients send the conversation so far, reply included, as the next
  turn's prompt;
- a new session reuses at most all but its last prompt row, which it must
  compute for its first token's logits (the caller passes that bound);
- a block is named only after the forward that wrote it ran.

Blocks nobody references stay cached (`idle`, least recently used first)
and count as free: the pool (specd_core/runtime/kv_budget.py) hands one out,
forgetting its name, only when no never-used block is left.

Pure bookkeeping, held by the pool and used under its lock; no torch, no grpc.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

DIGEST_BYTES = 16  # blake2b-128: a collision would silently serve another prompt's rows


def chain_seed(model: str, dtype: str, salt: str = "") -> bytes:
    """The hash chain's start for one model, cache dtype and cache_salt: chains
    of different seeds never meet (different salts share no block)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in (model, dtype, salt):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no ambiguity between parts
    return h.digest()


def block_hashes(seed: bytes, tokens: list[int], block_rows: int) -> list[bytes]:
    """The name of each FULL block of `tokens`, each chained on the one before."""
    names, prev = [], seed
    for i in range(len(tokens) // block_rows):
        block = array("q", tokens[i * block_rows : (i + 1) * block_rows]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=DIGEST_BYTES).digest()
        names.append(prev)
    return names


class PrefixCache:
    """Named blocks of one pool: their references and the idle ones' order.

    model: what the chain is seeded with besides a request's salt (the model
    directory and revision, and the cache dtype)."""

    def __init__(self, model: str, dtype: str):
        self.model, self.dtype = model, dtype
        self.block_of: dict[bytes, int] = {}  # name -> block id
        self.name_of: dict[int, bytes] = {}  # block id -> name
        self.refs: dict[int, int] = {}  # named block -> sessions holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; least recently used first
        # What the replica reports (Prometheus, like vLLM's prefix_cache_queries / _hits, in tokens).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        # Told each lookup's (queried, hit) tokens: the replica's Prometheus counters.
        self.on_query: Callable[[int, int], None] | None = None

    def names(self, tokens: list[int], block_rows: int, salt: str = "") -> list[bytes]:
        return block_hashes(chain_seed(self.model, self.dtype, salt), tokens, block_rows)

    def __contains__(self, block: int) -> bool:
        return block in self.name_of

    def lookup(self, names: list[bytes]) -> list[int]:
        """The blocks of the longest cached run of `names` from the first."""
        out = []
        for n in names:
            b = self.block_of.get(n)
            if b is None:
                break
            out.append(b)
        return out

    def ref(self, block: int) -> bool:
        """One more session holds a named block; True if it was idle (so the
        pool counts it as used again)."""
        self.refs[block] += 1
        if self.refs[block] == 1:
            del self.idle[block]
            return True
        return False

    def unref(self, block: int) -> bool:
        """A session gives a named block back; True if nobody holds it now (it
        stays cached, most recently used)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.idle[block] = None
            return True
        return False

    def name(self, block: int, name: bytes) -> bool:
        """Name a block its session computed (and still holds). False when
        another block has that name already (computed at the same time): this
        one stays the session's own."""
        if name in self.block_of or block in self.name_of:
            return False
        self.block_of[name], self.name_of[block], self.refs[block] = block, name, 1
        return True

    def evict(self) -> int:
        """Forget the least recently used idle block; its id."""
        block, _ = self.idle.popitem(last=False)
        del self.block_of[self.name_of.pop(block)], self.refs[block]
        self.evicted_blocks += 1
        return block

    def observe(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit
        if self.on_query is not None:
            self.on_query(queried, hit)

    def describe(self) -> dict:
        """The figures a replica reports (ReplicaInfo's prefix_* fields)."""
        return {
            "prefix_caching": True,
            "prefix_cached_blocks": len(self.name_of),
            "prefix_idle_blocks": len(self.idle),
            "prefix_queried_tokens": self.queried_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_evicted_blocks": self.evicted_blocks,
        }


def reuse_prefix(cache, prompt_rows: list[int], salt: str, limit: int) -> int:
    """A new session's cache (LeanSession.reuse_prefix) starts after its
    longest cached prefix within `limit` rows; the rows reused. Caches without
    prefix caching (Hugging Face's, an EAGLE head's) reuse nothing."""
    reuse = getattr(cache, "reuse_prefix", None)
    return reuse(prompt_rows, salt, limit) if reuse is not None else 0


def publish_prefix(cache) -> None:
    """After a new session's prefill: cache its own full prompt blocks."""
    publish = getattr(cache, "publish_prefix", None)
    if publish is not None:
        publish()


def publish_rows(cache, rows: list[int]) -> None:
    """As a session ends: cache the full blocks of all its rows (their tokens
    `rows`: prompt and generated), for the next turn of its conversation."""
    publish = getattr(cache, "publish_rows", None)
    if publish is not None:
        publish(rows)
