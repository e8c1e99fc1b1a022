"""The drafter core: per-session state and KV cache, K-token proposals, rollback.

Session invariant: `tokens` are the committed ids the drafter knows of; the cache
holds a prefix of tokens + the drafts it forwarded last time. On each Propose the
cache is first cut back to what the verifier kept, then the tokens not yet in the
cache are forwarded together with each new draft token (autoregressive, K steps).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from specd.errors import InvalidRequest, UnknownSession, CapacityExceeded
from specd.models import Runner, context_length, load_model, vocab_size
from specd.sampling import SamplingParams, logits_to_probs, truncate_top
from specd.validation import check_token_ids

from .config import DrafterConfig


@dataclass
class Proposal:
    token_ids: list[int]
    # Sampled drafts only: per token, the (ids, probs) it was drawn from.
    distributions: list[tuple[list[int], list[float]]] = field(default_factory=list)
    compute_ms: float = 0.0


@dataclass
class _Session:
    cache: object                # a Runner session: forward / rollback / length
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int]
    last_draft: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, config: DrafterConfig, model=None):
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model = model if model is not None else load_model(config.model_dir, config.device, config.dtype)
        self.runner = Runner(self.model, config.engine)
        self.vocab_size = vocab_size(self.model)
        self.context_length = context_length(self.model.config)
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def open_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        check_token_ids(prompt_ids, self.vocab_size, self.context_length, "prompt_token_ids")
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} is already open")
            if len(self._sessions) >= self.config.max_sessions:
                raise CapacityExceeded(f"drafter is at its limit of {self.config.max_sessions} sessions")
            # A distinct stream from the verifier's: draft randomness must be
            # independent of the acceptance randomness.
            gen = torch.Generator().manual_seed((params.seed * 2654435761 + 1) % 2**63)
            s = _Session(self.runner.new_session(), params, gen, list(prompt_ids))
            # Prefill all but the last prompt token now (overlaps the verifier's
            # prefill); the last one is forwarded with the first proposal.
            if len(prompt_ids) > 1:
                s.cache.forward(prompt_ids[:-1], last_only=True)
            self._sessions[session_id] = s

    def propose(self, session_id: str, num_accepted: int, committed: list[int], k: int) -> Proposal:
        s = self._get(session_id)
        if not (1 <= k <= self.config.max_draft_tokens):
            raise InvalidRequest(f"num_draft_tokens must be in [1, {self.config.max_draft_tokens}], got {k}")
        if not (0 <= num_accepted <= len(s.last_draft)):
            raise InvalidRequest(f"num_accepted={num_accepted} but the last draft had {len(s.last_draft)} tokens")
        if committed[:num_accepted] != s.last_draft[:num_accepted]:
            raise InvalidRequest("committed_token_ids do not start with the accepted draft tokens")
        check_token_ids(committed, self.vocab_size, None, "committed_token_ids", allow_empty=True)
        if len(s.tokens) + len(committed) + k - 1 > self.context_length:
            raise InvalidRequest(f"{k} draft tokens would pass the drafter's context length {self.context_length}")
        with self._lock:
            start = time.perf_counter()
            # The cache holds tokens + last_draft[:-1]; what stays valid is the
            # kept part of that draft.
            s.cache.rollback(min(s.cache.length, len(s.tokens) + num_accepted))
            s.tokens += committed
            pending = s.tokens[s.cache.length:]
            proposal = Proposal([])
            for _ in range(k):
                logits = s.cache.forward(pending, last_only=True)[0]
                if s.params.greedy:
                    tok = int(logits.argmax())
                else:
                    ids, probs = truncate_top(logits_to_probs(logits, s.params), self.config.draft_top_n)
                    tok = int(ids[torch.multinomial(probs, 1, generator=s.generator)])
                    proposal.distributions.append((ids.tolist(), probs.tolist()))
                proposal.token_ids.append(tok)
                pending = [tok]
            # The last draft token was never forwarded: the cache now holds
            # tokens + drafts[:-1], which the next Propose cuts to what was kept.
            s.last_draft = proposal.token_ids
            proposal.compute_ms = (time.perf_counter() - start) * 1e3
            return proposal

    def close_session(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise UnknownSession(f"unknown session id {session_id!r}")

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSession(f"unknown session id {session_id!r}")
        return s
