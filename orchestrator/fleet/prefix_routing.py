"""Which replica likely caches a new session's prompt prefix (docs/prefix_caching.md#routing).

Each model replica caches the KV blocks of the prompts it prefilled
(specd_core/runtime/prefix_cache.py), but only its own: a session whose prompt
starts like an earlier one skips that prefix's prefill only on the replica
that served the earlier one. The pool (orchestrator/fleet/pool.py) routes a
new session there unless that replica is too busy; this module remembers where
this orchestrator sent which prompts.

`PrefixTable`: per replica name, the prompts sent there, cut into chunks of
`chunk` tokens, each chunk named by a hash chained over every chunk up to and
including it (so a name stands for the whole prefix), seeded by the request's
`cache_salt` (requests of different salts never match, as on the replicas).
`matched` = how many leading tokens of a prompt (whole chunks) were sent to a
replica. Each replica keeps at most `capacity` names, least recently recorded
dropped first; a prompt's names are recorded tail first, so that its head,
which more prompts share, is dropped last, and a prefix never loses its head
while its tail stays. Memory: a name is a 63-bit int in an OrderedDict, about
140 bytes, so the default 100,000 names per replica (1.6 M prompt tokens, more
than most replicas' KV caches hold) take about 14 MB per replica.

Approximate by design: the table knows only what THIS orchestrator sent (each
of several orchestrators keeps its own), not what the replica still holds (it
may have evicted a prefix the table lists) nor its block size (a chunk is finer
than a KV block). A wrong guess costs a prefill, never a wrong output.

`PrefixRouting`: the table and the rule's bound (pool.py applies it; its
defaults and flags: orchestrator/config.py). Pure: no grpc, no Ray.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from orchestrator.config import DEFAULT_PREFIX_ROUTING_BOUND, DEFAULT_PREFIX_ROUTING_SLACK, OrchestratorConfig

CHUNK_TOKENS = 16
CAPACITY = 100_000  # chunk names per replica


def chunk_names(prompt: Sequence[int], salt: str, chunk: int = CHUNK_TOKENS) -> list[int]:
    """One name per whole chunk of the prompt, each chained over all before it."""
    h = hashlib.blake2b(b"specd-route\0" + salt.encode(), digest_size=8).digest()
    out = []
    for start in range(0, len(prompt) - chunk + 1, chunk):
        h = hashlib.blake2b(h + struct.pack(f"<{chunk}i", *prompt[start : start + chunk]), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 1)
    return out


class PrefixTable:
    """Per replica: the prompt prefixes sent there (a bounded LRU of chunk names)."""

    def __init__(self, chunk: int = CHUNK_TOKENS, capacity: int = CAPACITY):
        if chunk < 1 or capacity < 1:
            raise ValueError(f"want chunk >= 1 and capacity >= 1, got {chunk}, {capacity}")
        self.chunk, self.capacity = chunk, capacity
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def names(self, prompt: Sequence[int], salt: str) -> list[int]:
        return chunk_names(prompt, salt, self.chunk)

    def matched(self, replica: str, prompt: Sequence[int], salt: str = "") -> int:
        """Leading tokens of the prompt (whole chunks) sent to the replica before."""
        return self.matched_names(replica, self.names(prompt, salt))

    def matched_names(self, replica: str, names: Iterable[int]) -> int:
        sent = self._sent.get(replica)
        n = 0
        if sent:
            for name in names:
                if name not in sent:
                    break
                n += 1
        return n * self.chunk

    def record(self, replica: str, prompt: Sequence[int], salt: str = "") -> None:
        """The prompt was sent to the replica (which caches its prefix now)."""
        self.record_names(replica, self.names(prompt, salt))

    def record_names(self, replica: str, names: Sequence[int]) -> None:
        sent = self._sent.setdefault(replica, OrderedDict())
        for name in reversed(names[: self.capacity]):  # the head last: the most recent
            if name in sent:
                sent.move_to_end(name)
            else:
                sent[name] = None
        while len(sent) > self.capacity:
            sent.popitem(last=False)

    def forget(self, replica: str) -> None:
        """The replica's cache is gone (removed, lost, restarted)."""
        self._sent.pop(replica, None)

    def size(self, replica: str) -> int:
        """Chunk names held for the replica."""
        return len(self._sent.get(replica, ()))


@dataclass
class PrefixRouting:
    """The rule's parameters and its table. A replica that caches a new
    session's prefix takes it only while it would then hold at most
    `bound` x (the least-loaded serving replica's sessions) + `slack`."""

    bound: float = DEFAULT_PREFIX_ROUTING_BOUND
    slack: int = DEFAULT_PREFIX_ROUTING_SLACK
    table: PrefixTable = field(default_factory=PrefixTable)

    def __post_init__(self) -> None:
        if not (self.bound >= 0 and self.slack >= 0):
            raise ValueError(
                f"prefix routing wants bound >= 0 and slack >= 0, got bound {self.bound:g}, slack {self.slack}"
            )

    def within(self, sessions: int, least: int) -> bool:
        """Whether a replica holding `sessions` may take one more for its cache,
        the least-loaded serving one holding `least`."""
        return sessions + 1 <= self.bound * least + self.slack


def routing_from(config: OrchestratorConfig) -> PrefixRouting | None:
    """A pool's routing from the orchestrator's settings; None: by load alone."""
    if not config.prefix_routing:
        return None
    return PrefixRouting(config.prefix_routing_bound, config.prefix_routing_slack)
