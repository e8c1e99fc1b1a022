"""The verifier core: prefill, one-forward verify with a lossless rule, rollback.

Session invariant: `tokens` are the committed ids (prompt + generated); the KV
cache holds all of them but the last, which is "pending": every verify forwards
[pending, d1..dK] in ONE pass, so the K+1 logits rows score each draft position
and the bonus position. Afterwards the cache is cropped back to the kept prefix
(no copy). No grpc here: the servicer translates.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from specd.acceptance import accept_deterministic, accept_greedy, accept_sampled, dense_q
from specd.errors import CapacityExceeded, InvalidRequest, UnknownSession
from specd.models import Runner, context_length, load_model, vocab_size
from specd.sampling import SamplingParams, logits_to_probs, sample
from specd.validation import check_token_ids

from .config import VerifierConfig


@dataclass
class VerifyResult:
    num_accepted: int
    tokens: list[int]          # kept drafts + correction or bonus
    compute_ms: float          # forward + acceptance + rollback


@dataclass
class _Session:
    cache: object                # a Runner session: forward / rollback / length
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)


class Verifier:
    def __init__(self, config: VerifierConfig, model=None):
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model = model if model is not None else load_model(config.model_dir, config.device, config.dtype)
        self.runner = Runner(self.model, config.engine)
        self.vocab_size = vocab_size(self.model)
        self.context_length = context_length(self.model.config)
        self._sessions: dict[str, _Session] = {}
        # One forward at a time: concurrent forwards on 2 CPU cores only thrash.
        # (Batching concurrent sessions into one forward is a later step.)
        self._lock = threading.Lock()

    # -- introspection (health, tests, metrics) --
    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens(self) -> int:
        return sum(s.cache.length for s in self._sessions.values())

    def open_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Prefill the prompt; return the first generated token (a plain decode step)."""
        params.validate()
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        check_token_ids(prompt_ids, self.vocab_size, self.context_length, "prompt_token_ids")
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequest(f"session {session_id!r} is already open")
            if len(self._sessions) >= self.config.max_sessions:
                raise CapacityExceeded(f"verifier is at its limit of {self.config.max_sessions} sessions")
            if self.kv_tokens + len(prompt_ids) > self.config.max_kv_tokens:
                raise CapacityExceeded(
                    f"verifier KV budget full: {self.kv_tokens} of {self.config.max_kv_tokens} tokens in use")
            gen = torch.Generator().manual_seed(params.seed)
            s = _Session(self.runner.new_session(), params, gen, list(prompt_ids))
            logits = s.cache.forward(prompt_ids, last_only=True)[0]
            first = sample(logits_to_probs(logits, params), gen) if not params.greedy else int(logits.argmax())
            s.tokens.append(first)
            self._sessions[session_id] = s
            return first

    def verify(self, session_id: str, draft_ids: list[int],
               draft_dists: list[tuple[list[int], list[float]]] | None = None) -> VerifyResult:
        """ONE forward over [pending] + draft; keep a lossless prefix; roll back."""
        s = self._get(session_id)
        k = len(draft_ids)
        if k > self.config.max_draft_tokens:
            raise InvalidRequest(f"{k} draft tokens is over this verifier's limit of {self.config.max_draft_tokens}")
        check_token_ids(draft_ids, self.vocab_size, None, "draft_token_ids", allow_empty=True)
        if len(s.tokens) + k > self.context_length:
            raise InvalidRequest(
                f"{k} draft tokens after {len(s.tokens)} committed would pass the context length {self.context_length}")
        if draft_dists and len(draft_dists) != k:
            raise InvalidRequest(f"got {len(draft_dists)} draft distributions for {k} draft tokens")
        q = self._dense_q(draft_dists) if draft_dists else None
        with self._lock:
            start = time.perf_counter()
            base = s.cache.length                       # == len(tokens) - 1
            logits = s.cache.forward([s.tokens[-1]] + list(draft_ids))  # (K+1, V)
            if s.params.greedy:
                result = accept_greedy(logits, list(draft_ids))
            else:
                p = logits_to_probs(logits, s.params)
                result = (accept_sampled(p, list(draft_ids), q, s.generator) if q is not None
                          else accept_deterministic(p, list(draft_ids), s.generator))
            # Keep pending + accepted drafts in the cache; the new last token is pending.
            s.cache.rollback(base + 1 + result.num_accepted)
            s.tokens += result.tokens
            return VerifyResult(result.num_accepted, result.tokens, (time.perf_counter() - start) * 1e3)

    def close_session(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise UnknownSession(f"unknown session id {session_id!r}")

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSession(f"unknown session id {session_id!r}")
        return s

    def _dense_q(self, dists: list[tuple[list[int], list[float]]]) -> torch.Tensor:
        for i, (ids, probs) in enumerate(dists):
            if len(ids) != len(probs) or not ids:
                raise InvalidRequest(f"draft distribution {i}: {len(ids)} ids but {len(probs)} probs")
            check_token_ids(ids, self.vocab_size, None, f"draft_distributions[{i}].token_ids")
            if any(not (0.0 <= p <= 1.0) for p in probs) or abs(sum(probs) - 1.0) > 1e-3:
                raise InvalidRequest(f"draft distribution {i} is not a probability distribution (sum {sum(probs):.4f})")
        return dense_q([d[0] for d in dists], [d[1] for d in dists], self.vocab_size)
