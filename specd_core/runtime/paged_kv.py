"""The lean engine's paged KV cache: one tensor of fixed-size blocks per
replica, and sessions that each hold a table of block ids.

Storage (`PagedKV.data`): (layers, rows, 2 (K, V), kv_heads, head_dim), rows
= (blocks + 2) x block_rows. Block id b of the pool is storage block b + 2;
storage block 0 is zeros and never handed out: attention reads it where a
session of a padded batch has no row (specd_core/runtime/lean_step.py), and
zeros are finite where the rest of the storage is uninitialised memory.
Storage block 1 is never handed out either: the rows a CUDA graph's padding
writes go there (specd_core/runtime/step_graphs.py), and nothing reads them
unmasked.

A row's keys and values are contiguous, so gathering a session's rows
copies 2 x kv_heads x head_dim elements at a time (index_select on rows:
3-7x faster on a CPU than indexing a (2, rows, ...) layout), and a block of
one layer is one contiguous range of memory (on a CPU its pages become resident when first
written: `torch.empty` costs no RAM for blocks never used).

The pool (specd_core/runtime/kv_budget.py) owns the storage (`pool.storage`)
and the block ids; the budget's pool is sized at the replica's start. A
session reserves by taking block ids (nothing is copied, ever; the pool
places them in runs where it can, so that a session's rows usually lie in one
range of storage, `run_from` / `in_one_run`), rolls back by
setting its length, compacts by moving kept rows within its own blocks, and
releases by giving its ids back. With prefix caching (prefix_cache.py) a new
session starts on the cached blocks of its prompt's longest cached prefix,
shared with other sessions, and caches its own full prompt blocks after its
prefill; rows below `frozen` are never written, rolled back or compacted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd_core.runtime.kv_budget import KVPool

if TYPE_CHECKING:
    from specd_core.runtime.lean import LeanModel

NULL_BLOCK = 2  # storage blocks before the pool's: block 0, zeros; block 1, padding's writes
SCRATCH_BLOCK = 1


class PagedKV:
    """The storage of one pool's blocks for one model's shape."""

    def __init__(self, model: LeanModel, pool: KVPool):
        self.shape = (len(model.layers), model.n_kv, model.head_dim)
        self.dtype, self.device = model.kv_dtype, model.device
        self.block_rows = pool.block_rows
        self.blocks = 0
        self.data = self._alloc(pool.total_blocks)

    @torch.inference_mode()
    def _alloc(self, blocks: int) -> torch.Tensor:
        layers, n_kv, head_dim = self.shape
        rows = (blocks + NULL_BLOCK) * self.block_rows
        data = torch.empty(layers, rows, 2, n_kv, head_dim, dtype=self.dtype, device=self.device)
        data[:, : NULL_BLOCK * self.block_rows].zero_()
        self.blocks = blocks
        return data

    @torch.inference_mode()
    def cover(self, blocks: int) -> None:
        """Hold at least `blocks` blocks: a growable pool's storage grows by
        a copy (a budget's pool is allocated whole and never does)."""
        if blocks <= self.blocks:
            return
        old = self.data
        self.data = self._alloc(max(blocks, 2 * self.blocks))
        self.data[:, : old.shape[1]] = old

    def fits(self, model: LeanModel) -> bool:
        return self.shape == (len(model.layers), model.n_kv, model.head_dim) and self.dtype == model.kv_dtype


def storage_of(model: LeanModel, pool: KVPool) -> PagedKV:
    """The pool's storage, made on first use for this model's rows."""
    store = pool.storage
    if store is None:
        store = pool.storage = PagedKV(model, pool)
    if not isinstance(store, PagedKV) or not store.fits(model):
        raise ValueError(f"the {pool.owner} KV pool already holds another model's rows")
    return store


class LeanSession:
    """One session's KV rows: a table of the pool's blocks and a length.

    reserve takes blocks by max(the blocks needed, GROWTH of those held):
    the pool's accounting of a session's growth is the same whatever the
    storage, and a step rarely has to take the pool's lock. Without a pool
    (tests, tools) the model's own growable pool serves (LeanModel.default_pool)."""

    GROWTH = 0.25  # a grow adds at least this fraction of the capacity (and at least one block)
    ROOM = 8  # free blocks a new session's first ones are placed before (when the pool has such a run)

    def __init__(self, model: LeanModel, max_len: int, pool: KVPool | None = None):
        self.lean = model
        self.max_len = max_len
        self.pool = pool if pool is not None else model.default_pool
        self.store = storage_of(model, self.pool)
        self.block_rows = self.pool.block_rows
        self.table: list[int] = []  # storage block of each block of rows, in order
        self.run_from = 0  # table[run_from:] are consecutive storage blocks (one range of rows)
        self.length = 0
        # Prefix caching (specd_core/runtime/prefix_cache.py): the names of the
        # full blocks of the prompt rows, and the rows below which every block
        # is shared or may be (named): never written, rolled back or compacted.
        self.names: list[bytes] = []
        self.frozen = 0
        self.salt: str | None = None  # the request's cache_salt once it looked its prompt up (None: never)

    @property
    def capacity(self) -> int:
        """Rows the session holds without taking blocks."""
        return len(self.table) * self.block_rows

    @property
    def blocks(self) -> int:
        """Blocks of the pool this session holds."""
        return len(self.table)

    def slot(self, row: int) -> int:
        """The storage row of the session's row `row`."""
        return self.table[row // self.block_rows] * self.block_rows + row % self.block_rows

    def slots(self, start: int, end: int) -> list[int]:
        """The storage rows of rows [start, end)."""
        b, tab = self.block_rows, self.table
        return [tab[r // b] * b + r % b for r in range(start, end)]

    @property
    def kv(self) -> torch.Tensor:
        """A copy of the rows held, (layers, 2, kv_heads, capacity, head_dim) (tests, tools)."""
        idx = torch.tensor(self.slots(0, self.capacity), dtype=torch.long, device=self.store.device)
        return self.store.data[:, idx].permute(0, 2, 3, 1, 4)

    def reserve(self, rows: int, what: str = "a session") -> None:
        """Hold `rows` rows: take max(the blocks needed, GROWTH of those held),
        or just the blocks needed when the pool has no more. CapacityExceeded
        when even those are not free; the session is unchanged then."""
        if rows > self.max_len:
            raise ValueError(f"{rows} rows exceed the model's context of {self.max_len}")
        if rows <= self.capacity:
            return
        have, limit = self.blocks, -(-self.max_len // self.block_rows)
        need = -(-rows // self.block_rows) - have
        want = min(max(need, max(1, int(have * self.GROWTH))), limit - have)
        # In a run after its last block, or a new session's with room to grow
        # into (as much again as it takes, at least ROOM): rows read in place.
        after = self.table[-1] - NULL_BLOCK if self.table else None
        room = 0 if self.table else min(max(want, self.ROOM), limit - want)
        ids = self.pool.take_blocks(want, need, what, after, room)
        try:
            self.store.cover(max(ids) + 1)
        except BaseException:  # out of memory growing a default pool's storage
            self.pool.give_blocks(ids)
            raise
        self._extend([i + NULL_BLOCK for i in ids])

    def _extend(self, blocks: list[int]) -> None:
        """Append storage blocks to the table, keeping `run_from`."""
        t = self.table
        for b in blocks:
            if t and t[-1] + 1 != b:
                self.run_from = len(t)
            t.append(b)

    def in_one_run(self, start: int) -> bool:
        """Whether the rows from `start` to the capacity lie in one range of storage."""
        return start // self.block_rows >= self.run_from

    def release(self) -> None:
        """Give the blocks back (the session is over)."""
        ids, self.table, self.length, self.run_from = [b - NULL_BLOCK for b in self.table], [], 0, 0
        self.names, self.frozen, self.salt = [], 0, None
        self.pool.give_blocks(ids)

    def reuse_prefix(self, prompt_rows: list[int], salt: str, limit: int) -> int:
        """A new session's start from the pool's prefix cache: name the full
        blocks of the prompt rows it will hold, take the longest cached run of
        them within `limit` rows (the rows the caller need not compute) and
        stand after it. The rows reused (0 without prefix caching)."""
        cache = self.pool.prefix
        if cache is None or self.table:
            return 0
        self.names, self.salt = cache.names(prompt_rows, self.block_rows, salt), salt
        ids = self.pool.share(self.names[: max(0, limit) // self.block_rows])
        self._extend([b + NULL_BLOCK for b in ids])
        self.length = self.frozen = len(ids) * self.block_rows
        cache.observe(len(prompt_rows), self.length)
        return self.length

    def publish_prefix(self) -> None:
        """After the prefill's forward: cache the session's own full prompt
        blocks (reuse_prefix named them), which it never writes again."""
        b = self.block_rows
        mine = [(self.table[i] - NULL_BLOCK, n) for i, n in enumerate(self.names) if (i + 1) * b <= self.length]
        mine = mine[self.frozen // b :]
        if mine:
            self.pool.name_blocks(mine)
            self.frozen = max(self.frozen, (self.frozen // b + len(mine)) * b)

    def publish_rows(self, rows: list[int]) -> None:
        """As the session ends: cache the full blocks of all its rows, whose
        tokens `rows` are (its prompt and what it generated), so that a later
        prompt carrying the conversation on starts after them too. It writes
        nothing more, so a named block is still never written again. Only when
        the rows are exactly the cache's (no draft rows past them)."""
        cache = self.pool.prefix
        if cache is None or self.salt is None or len(rows) != self.length:
            return
        self.names = cache.names(rows, self.block_rows, self.salt)
        self.publish_prefix()

    def forward(self, token_ids: list[int], last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        return self.lean.forward(self, token_ids, positions, mask, last_only)

    def rollback(self, length: int) -> None:
        if not self.frozen <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}, {self.frozen} of them shared")
        self.length = length

    @torch.inference_mode()
    def compact(self, start: int, keep: list[int]) -> None:
        """Keep rows start+keep[j] at start+j (keep ascending), drop the rest:
        the kept rows move within the session's blocks, every layer at once."""
        moved = [(start + k, start + j) for j, k in enumerate(keep) if k != j]  # a kept prefix is in place
        if moved and moved[0][1] < self.frozen:
            raise ValueError(f"compaction would write row {moved[0][1]}, below the {self.frozen} shared rows")
        if moved:
            pairs = torch.tensor([[self.slot(a), self.slot(b)] for a, b in moved], device=self.store.device)
            data = self.store.data
            data[:, pairs[:, 1]] = data[:, pairs[:, 0]]
        self.rollback(start + len(keep))
