"""What the drafter and verifier cores share: the loaded model and how it
runs (runner, vocabulary, context, KV budget, structured-output grammar), the
session table they hold (specd_core/runtime/sessions.py) and the checks every
new session passes. The cores extend it with their own calls; it calls
nothing of theirs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from specd_core.errors import InvalidRequest
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.structured import OutputConstraint
from specd_core.rules.validation import check_token_ids
from specd_core.runtime import step_graphs
from specd_core.runtime.grammar import Constraint, GrammarEngine, engine_of, eos_ids, try_engine
from specd_core.runtime.hub import model_label
from specd_core.runtime.kv_budget import DEFAULT_BLOCK_ROWS, KVPool, budget_bytes
from specd_core.runtime.lean_load import load_checkpoint
from specd_core.runtime.models import (
    ModelRunner,
    Runner,
    architecture,
    context_length,
    load_model,
    load_tokenizer,
    vocab_size,
)
from specd_core.runtime.prefix_cache import PrefixCache
from specd_core.runtime.sessions import SessionTable
from specd_core.runtime.token_text import TokenizerUnsupported

log = logging.getLogger(__name__)

MAX_SESSION_ID = 256


def _load(config):
    """The model a core serves. Where the lean engine will run it, straight
    from the checkpoint (specd_core/runtime/lean_load.py): a fresh process then
    does not import HF's modeling stack, ~2 s of CPU per replica start.
    Elsewhere (the hf engine, a checkpoint that path does not cover) HF's load."""
    if config.engine != "hf":
        ckpt = load_checkpoint(config.model_dir, config.device, config.dtype)
        if ckpt is not None:
            return ckpt
    return load_model(config.model_dir, config.device, config.dtype)


class ModelCore:
    """role: "drafter" | "verifier", for messages. runner_of: what runs the
    forwards, made from the model's own runner (default: that runner; an
    EAGLE head wraps it, drafter_svc/eagle.py) before the KV budget is sized
    by its rows. tokenizer_dir: where structured output reads the tokenizer
    (default: the model's directory)."""

    def __init__(
        self,
        config,
        role: str,
        model=None,
        runner_of: Callable[[ModelRunner], ModelRunner] | None = None,
        tokenizer_dir: str | None = None,
    ):
        self.config, self.role = config, role
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model = model if model is not None else _load(config)
        runner: ModelRunner = Runner(self.model, config.engine)
        self.runner = runner_of(runner) if runner_of is not None else runner
        # The ids it serves: the output layer's rows, or what its runner maps
        # them to (an EAGLE-3 head's draft vocabulary lands on the target's ids).
        self.vocab_size = getattr(self.runner, "vocab_size", None) or vocab_size(self.model)
        self.context_length = context_length(self.model.config)
        self.kv_pool = self._install_kv_pool()
        self.sessions = SessionTable(
            role, config.max_sessions, config.session_idle_timeout_s, getattr(config, "owner_timeout_s", 0.0)
        )
        self.tokenizer_dir = tokenizer_dir or config.model_dir
        # Built on the first constrained session; kept, engine or reason, so a
        # tokenizer it cannot run over is read (and logged) once.
        self._grammar: GrammarEngine | TokenizerUnsupported | None = None
        self._grammar_lock = threading.Lock()

    def _install_kv_pool(self) -> KVPool:
        """The replica's KV budget (specd_core/runtime/kv_budget.py), sized now that
        the weights are loaded, for the runner's sessions to take blocks from."""
        cfg = self.config
        block = getattr(cfg, "kv_block_size", DEFAULT_BLOCK_ROWS)
        nbytes = budget_bytes(getattr(cfg, "kv_cache_memory", "auto"), self.model.device)
        pool = KVPool.of_bytes(nbytes, block, self.runner.kv_row_bytes, self.role)
        if getattr(cfg, "prefix_caching", True) and self.runner.lean is not None:
            # Seeded with what decides a block's rows besides its tokens: which
            # weights (directory and revision) and the cache's dtype.
            model = f"{cfg.model_dir}@{getattr(cfg, 'revision', None) or ''}"
            pool.prefix = PrefixCache(model, str(self.runner.kv_dtype))
        self.runner.kv_pool = pool
        log.info(
            "%s KV budget: %d blocks of %d tokens (%d tokens, %.1f MiB at %d bytes per token)",
            self.role,
            pool.total_blocks,
            block,
            pool.capacity_tokens,
            pool.capacity_bytes / 2**20,
            pool.row_bytes,
        )
        return pool

    def info(self) -> dict:
        """What the replica reports of itself (ReplicaInfo): its engine, model,
        dtype and KV budget and use."""
        return {
            "model": model_label(self.config.model_dir),
            "engine": self.runner.engine,
            "architecture": architecture(self.model.config),
            "model_type": str(getattr(self.model.config, "model_type", "")),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "kv_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "sessions": self.num_sessions,
            "cuda_graphs": step_graphs.describe(getattr(self.runner, "lean", None)),
            **self.kv_pool.describe(),
        }

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def active_sessions(self) -> int:
        """Open sessions expected to call soon (SessionTable.active)."""
        return self.sessions.active()

    def batch_share(self) -> int:
        """Verifies of open sessions one batch takes (SessionTable.batch_share)."""
        return self.sessions.batch_share()

    def close_session(self, session_id: str) -> None:
        self.sessions.close(session_id)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Close the sessions idle past `session_idle_timeout_s` (SessionTable.expire_idle)."""
        return self.sessions.expire_idle(now)

    def expire_orphans(self, now: float | None = None) -> list[str]:
        """Close the sessions of owners silent past `owner_timeout_s` (SessionTable.expire_orphans)."""
        return self.sessions.expire_orphans(now)

    def keep_alive(self, owner: str) -> tuple[int, float]:
        """An owner says it is alive: (its sessions here, the owner timeout it must beat)."""
        return self.sessions.heard(owner), self.sessions.owner_timeout_s

    @property
    def grammar(self) -> GrammarEngine:
        """The structured-output engine over this model's tokenizer, built once
        (reading the tokenizer takes about a second)."""
        with self._grammar_lock:
            if self._grammar is None:
                try:
                    tokenizer = load_tokenizer(self.tokenizer_dir)
                except (OSError, ValueError) as exc:
                    raise InvalidRequest(
                        f"structured output needs the model's tokenizer, and the {self.role} could not load one "
                        f"from {self.tokenizer_dir!r}: {exc}"
                    ) from None
                self._grammar = try_engine(tokenizer, eos_ids(self.model.config, tokenizer))
            return engine_of(self._grammar)

    def constraint(
        self, c: OutputConstraint | None, prompt_ids: Sequence[int] = (), generated_from: int = 0
    ) -> Constraint | None:
        """A new session's constraint (None: unconstrained), standing after
        the generated tokens prompt_ids[generated_from:] (a rebuilt session's;
        0 = none generated); InvalidRequest for a bad constraint."""
        if c is None:
            return None
        if not 0 <= generated_from <= len(prompt_ids):
            raise InvalidRequest(f"generated_from {generated_from} is outside the {len(prompt_ids)} prompt_token_ids")
        generated = list(prompt_ids[generated_from:]) if generated_from else []
        return self.grammar.constraint(c, self.vocab_size, generated)

    def _check_request(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, vocab_size: int | None = None
    ) -> None:
        """The input checks of a new session (no lock needed). vocab_size: the
        ids the prompt may hold (default: this model's rows)."""
        params.validate()
        if not session_id:
            raise InvalidRequest("session_id must not be empty")
        if len(session_id) > MAX_SESSION_ID:  # ids are held in tables and echoed in messages and logs
            raise InvalidRequest(f"session_id has {len(session_id)} characters; at most {MAX_SESSION_ID} are allowed")
        check_token_ids(prompt_ids, vocab_size or self.vocab_size, self.context_length, "prompt_token_ids")
