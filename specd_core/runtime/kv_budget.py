"""A replica's KV cache memory budget: a pool of fixed-size blocks.

A block is `block_rows` cache rows (token positions) of one session; its bytes
are block_rows x the model's bytes per KV row (layers x 2 (K and V) x kv_heads
x head_dim x the cache's element size). Sessions take blocks as their cache
grows and give them back when they close or expire; what the pool does not
grant fails with CapacityExceeded (gRPC RESOURCE_EXHAUSTED) naming the budget.

Blocks are the unit of accounting AND of storage: the pool hands out block
ids (`take_blocks`), and the lean engine keeps every session's rows in one
tensor of the pool's blocks (`storage`, made by specd_core/runtime/paged_kv.py on
first use, sized by the budget), so a session's cache never moves and the
pool cannot run the device out of memory mid-batch. The Hugging Face engine's
sessions only count blocks (`take` / `give`): their caches are its own.

The budget is `--kv-cache-memory`: bytes ("512MiB", "4GiB", "1000000") or a
fraction in (0, 1] of the memory free once the weights are loaded
(`budget_bytes`). Pure bookkeeping plus that one measurement; no grpc.
"""

from __future__ import annotations

import math
import os
import re
import threading

import torch

from specd_core.errors import CapacityExceeded
from specd_core.runtime.prefix_cache import PrefixCache

# Rows per block. A verify adds at most max_tree_nodes + 1 rows (default 64 + 1)
# and a decode cycle K + 1 <= 17, so one cycle grows a session by one or two
# blocks; a session wastes under one block (here 64 rows: 2 MiB for a 7B Llama
# with 8 KV heads in fp16, negligible for the models this serves on CPUs).
# Smaller blocks would mean longer block tables (more index work per step),
# larger ones more memory held and not used.
DEFAULT_BLOCK_ROWS = 64

# The default budget, a fraction of the memory free after loading the weights.
# CUDA: 0.85 - the KV cache is what the rest of the GPU is for; 15% stays for
# activations (a batched forward's logits are rows x vocabulary floats), the
# allocator's fragmentation and other processes' CUDA contexts (vLLM's
# gpu_memory_utilization 0.9 counts the weights too). CPU: 0.5 - host RAM is
# shared with the OS, the page cache, the other replica (a drafter next to a
# verifier) and the orchestrator, and running out means the OOM killer, not
# an error; a host with several replicas should give each a byte count.
DEFAULT_FRACTION = {"cuda": 0.85, "cpu": 0.5}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """`--kv-cache-memory` -> (bytes, None) or (None, fraction); "" or "auto" ->
    (None, None), the device's default fraction. Raises ValueError naming the value."""
    t = str(text).strip().lower().replace(" ", "")
    if t in ("", "auto"):
        return None, None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([a-z]*)", t)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(
            f"kv_cache_memory {text!r}: want bytes (e.g. 512MiB, 4GiB, 1000000) or a fraction in (0, 1] "
            "of the memory free after loading the weights"
        )
    number, unit = m.group(1), m.group(2)
    value = float(number)
    if not unit and ("." in number or value <= 1):
        # A plain number up to 1 (or with a decimal point) is a fraction: "1"
        # means all the free memory (one byte would be no budget at all).
        if not 0 < value <= 1:
            raise ValueError(f"kv_cache_memory {text!r}: a fraction must be in (0, 1]")
        return None, value
    return int(value * _UNITS[unit]), None


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory free for the KV cache now: CUDA's free device memory, else the
    host's available RAM (MemAvailable: free plus reclaimable page cache)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def budget_bytes(setting: str, device: torch.device | str, free: int | None = None) -> int:
    """The budget in bytes for a `--kv-cache-memory` setting on this device
    (free: the memory free now, measured when not given)."""
    nbytes, fraction = parse_memory(setting)
    if nbytes is not None:
        return nbytes
    if fraction is None:
        fraction = DEFAULT_FRACTION["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return int(fraction * (free_memory_bytes(device) if free is None else free))


def kv_row_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one cache row (one token position) takes over all layers: K and V."""
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


FREE, TAKEN = b"\x01", b"\x00"  # a block's entry in a pool's free map


class KVPool:
    """`total_blocks` blocks of `block_rows` rows, `row_bytes` bytes per row,
    shared by the sessions of one replica. Thread-safe: the batcher's thread
    grows sessions while gRPC threads open and close them.

    growable: a pool without a budget (tests, tools: a lean model's own
    default) that adds blocks instead of refusing."""

    def __init__(
        self, total_blocks: int, block_rows: int, row_bytes: int, owner: str = "replica", growable: bool = False
    ):
        if block_rows < 1:
            raise ValueError(f"kv_block_size must be >= 1 rows, got {block_rows}")
        if total_blocks < 0 or row_bytes < 1:
            raise ValueError(f"bad pool: {total_blocks} blocks, {row_bytes} bytes per row")
        self.total_blocks, self.block_rows, self.row_bytes, self.owner = total_blocks, block_rows, row_bytes, owner
        self.growable = growable
        self._used = 0
        self._lock = threading.Lock()
        # Free block ids as a map (FREE at a free id), so that a session's
        # blocks can be placed in runs (`take_blocks`); searched by
        # bytearray.find, in C, lowest ids first.
        self._free = bytearray(FREE * total_blocks)
        # The engine's tensor of the blocks (paged_kv.PagedKV), made on first use.
        self.storage: object | None = None
        # Automatic prefix caching (specd_core/runtime/prefix_cache.py), set by
        # the replica's core for the lean engine; None: off. Its idle blocks
        # are neither used nor in _free, and count as free.
        self.prefix: PrefixCache | None = None

    @classmethod
    def of_bytes(cls, nbytes: int, block_rows: int, row_bytes: int, owner: str = "replica") -> KVPool:
        """As many whole blocks as fit in nbytes."""
        return cls(nbytes // (block_rows * row_bytes), block_rows, row_bytes, owner)

    @property
    def block_bytes(self) -> int:
        return self.block_rows * self.row_bytes

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._used

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.block_rows

    @property
    def used_tokens(self) -> int:
        return self._used * self.block_rows

    @property
    def capacity_bytes(self) -> int:
        return self.total_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return self._used * self.block_bytes

    def blocks_for(self, rows: int) -> int:
        """Blocks that hold `rows` rows."""
        return math.ceil(rows / self.block_rows) if rows > 0 else 0

    def take(self, want: int, need: int | None = None, what: str = "a session") -> int:
        """Take `want` blocks if free, else as many as are free down to `need`
        (default: want); return how many were taken. Fewer than `need` free:
        CapacityExceeded naming the budget, nothing taken."""
        with self._lock:
            return self._take(want, need, what)

    def _take(self, want: int, need: int | None, what: str) -> int:
        need = want if need is None else need
        if need < 0 or want < need:
            raise ValueError(f"bad request: want {want}, need {need} blocks")
        free = self.total_blocks - self._used
        if free < want and self.growable:
            grown = max(2 * self.total_blocks, self._used + want)
            self._free += FREE * (grown - self.total_blocks)
            self.total_blocks, free = grown, grown - self._used
        if free < need:
            raise CapacityExceeded(
                f"{self.owner} KV budget full: {what} needs {need} more block(s) of {self.block_rows} tokens, "
                f"{free} of {self.total_blocks} are free ({self.used_tokens} of {self.capacity_tokens} tokens, "
                f"{_mib(self.used_bytes)} of {_mib(self.capacity_bytes)} in use; --kv-cache-memory sets the budget)"
            )
        got = min(want, free)
        self._used += got
        return got

    def take_blocks(
        self, want: int, need: int | None = None, what: str = "a session", after: int | None = None, room: int = 0
    ) -> list[int]:
        """`take`, returning the ids of the blocks taken (0 <= id < total_blocks):
        free blocks first, then the least recently used idle cached ones.

        Placed in runs where the free map allows, so that a session's rows
        lie in one range of storage, which attention can read in place
        (specd_core/runtime/lean_step.py): `after` (a growing session's last
        block) the blocks right after it; else, with `room` (a new
        session's), a run with `room` free blocks on each side, so that it
        and the session before it can grow in place. Otherwise (or where no
        such run is free) the lowest free ids, wherever they are."""
        with self._lock:
            got = self._take(want, need, what)
            return self._place(got, after, room)

    def _place(self, n: int, after: int | None, room: int) -> list[int]:
        run, free = FREE * n, self._free
        start = -1
        if after is not None:
            if free[after + 1 : after + 1 + n] == run:
                start = after + 1
        elif room:
            at = free.find(FREE * (n + 2 * room))
            start = -1 if at < 0 else at + room if at > 0 else 0  # nothing before id 0 needs room
        if start < 0:
            start = free.find(run)  # any run of n, else one at a time
        if start >= 0:
            free[start : start + n] = TAKEN * n
            return list(range(start, start + n))
        ids = []
        for _ in range(n):
            b = free.find(FREE)
            if b < 0:  # no free block: an idle cached one (_take counted them)
                ids.append(self._evict())
            else:
                free[b] = TAKEN[0]
                ids.append(b)
        return ids

    def _evict(self) -> int:
        assert self.prefix is not None  # _take counted idle blocks as free
        return self.prefix.evict()

    def give(self, blocks: int) -> None:
        """Give back blocks taken before."""
        with self._lock:
            self._give(blocks)

    def _give(self, blocks: int) -> None:
        if not 0 <= blocks <= self._used:
            raise ValueError(f"giving back {blocks} blocks, but {self._used} are taken")
        self._used -= blocks

    def give_blocks(self, ids: list[int]) -> None:
        """Give back blocks taken with `take_blocks` or `share`: a cached block
        is free only once its last holder gives it back, and then stays cached
        (idle) until a take needs it."""
        with self._lock:
            cache = self.prefix
            own = [b for b in ids if cache is None or b not in cache]
            idle = sum(cache.unref(b) for b in ids if b not in own) if cache is not None else 0
            self._give(len(own) + idle)
            for b in own:
                self._free[b] = FREE[0]

    def share(self, names: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `names` (prefix_cache.py),
        each taken by one more holder; [] without prefix caching."""
        with self._lock:
            if self.prefix is None:
                return []
            ids = self.prefix.lookup(names)
            self._used += sum(self.prefix.ref(b) for b in ids)
            return ids

    def name_blocks(self, pairs: list[tuple[int, bytes]]) -> list[int]:
        """Cache blocks a session computed and holds, under their names; the
        ids now cached (a name taken already leaves its block the session's own)."""
        with self._lock:
            if self.prefix is None:
                return []
            return [b for b, name in pairs if self.prefix.name(b, name)]

    def check(self) -> None:
        """Every block is used, free or idle cached, once (tests: no block leaked)."""
        with self._lock:
            idle = list(self.prefix.idle) if self.prefix is not None else []
            free = [b for b, f in enumerate(self._free) if f == FREE[0]]
            held = self.total_blocks - len(free) - len(idle)
            if held != self._used or len(set(free) | set(idle)) != len(free) + len(idle):
                raise AssertionError(f"{self.owner} pool: {self._used} used, {held} neither free nor idle")

    def describe(self) -> dict:
        """The pool's figures (replica info, status, metrics)."""
        with self._lock:
            prefix = self.prefix.describe() if self.prefix is not None else {"prefix_caching": False}
        return prefix | {
            "kv_block_tokens": self.block_rows,
            "kv_capacity_blocks": self.total_blocks,
            "kv_used_blocks": self._used,
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_used_tokens": self.used_tokens,
            "kv_capacity_bytes": self.capacity_bytes,
            "kv_used_bytes": self.used_bytes,
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
