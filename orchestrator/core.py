"""The orchestrator core: validates a request, routes it to replicas, runs the loop."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import AsyncIterator

from transformers import AutoConfig

from specd.models import context_length, load_tokenizer

from .clients import GrpcDrafter, GrpcVerifier
from .config import OrchestratorConfig
from .detok import OutputTracker
from .loop import Chunk, run_generation
from .metrics import OrchestratorMetrics
from .ngram_drafter import NgramDrafter
from .request import build_spec
from .tracing import request_trace


def eos_ids(config) -> set[int]:
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


class Orchestrator:
    def __init__(self, config: OrchestratorConfig):
        if not config.verifier_addresses:
            raise ValueError("at least one verifier address is needed")
        self.config = config
        self.model_name = Path(config.target_dir).name     # gen_ai.request.model
        self.tokenizer = load_tokenizer(config.target_dir)
        target_cfg = AutoConfig.from_pretrained(config.target_dir)
        self.vocab_size = target_cfg.vocab_size
        self.target_ctx = context_length(target_cfg)
        self.eos_ids = eos_ids(target_cfg)
        self.drafter_ctx = self.target_ctx
        if config.drafter_dir and config.drafter_addresses:
            drafter_cfg = AutoConfig.from_pretrained(config.drafter_dir)
            if drafter_cfg.vocab_size != self.vocab_size:
                raise ValueError(f"drafter vocabulary ({drafter_cfg.vocab_size}) differs from the "
                                 f"target's ({self.vocab_size}); they must share a tokenizer")
            self.drafter_ctx = context_length(drafter_cfg)
        self.verifiers = [GrpcVerifier(a, config.rpc_timeout_s) for a in config.verifier_addresses]
        self.drafters = [GrpcDrafter(a, config.rpc_timeout_s) for a in config.drafter_addresses]
        sc = config.speculative.validate()
        if sc.method == "draft_model" and sc.num_speculative_tokens and not self.drafters:
            raise ValueError("speculative_config.method is draft_model but no drafter replica is deployed")
        self.ngram = NgramDrafter(sc.prompt_lookup_max, sc.prompt_lookup_min)
        self.metrics = OrchestratorMetrics()

    async def generate(self, request, trace_context=None) -> AsyncIterator[Chunk]:
        """Run one request; trace_context: the caller's (from its gRPC metadata)."""
        session_id = uuid.uuid4().hex
        trace = request_trace(trace_context, self.model_name, session_id)   # no-op unless tracing is on
        metrics = self.metrics.request()
        chunk, used = None, []
        try:
            spec = build_spec(request, self.config, self.tokenizer, self.vocab_size, self.target_ctx,
                              has_drafter=bool(self.drafters))
            trace.describe(spec)
            tracker = OutputTracker(self.tokenizer, self.eos_ids, spec.max_new_tokens,
                                    self.target_ctx - len(spec.prompt_ids), spec.stop)
            verifier = min(self.verifiers, key=lambda c: c.active)   # least loaded
            drafter = None
            if spec.method == "ngram":
                drafter = self.ngram
            elif spec.method == "draft_model":
                drafter = min(self.drafters, key=lambda c: c.active)
            used = [c for c in (verifier, drafter) if c is not None]
            for c in used:
                c.active += 1
            async for chunk in run_generation(spec, session_id, verifier, drafter, tracker,
                                              self.target_ctx, self.drafter_ctx, trace):
                metrics.observe(chunk, spec.method)
                yield chunk
        except BaseException as exc:   # also the client leaving (GeneratorExit, CancelledError)
            trace.finish(chunk, exc)
            raise
        else:
            trace.finish(chunk)
        finally:
            metrics.done()
            for c in used:
                c.active -= 1

    async def aclose(self) -> None:
        for c in self.verifiers + self.drafters + [self.ngram]:
            await c.aclose()
