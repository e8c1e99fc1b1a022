"""What the orchestrator knows of the models it serves: the target's tokenizer,
vocabulary, context length and end tokens, and what the drafter pool serves
(an EAGLE head or a draft model, checked to pair with the target). Read once
from the model directories when the orchestrator starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from orchestrator.config import OrchestratorConfig
from orchestrator.cycle.spec import ContextLengths
from orchestrator.pair import check_pair
from orchestrator.spec_config import DRAFTER_METHODS
from specd_core.runtime.grammar import GrammarEngine, engine_of, try_engine
from specd_core.runtime.grammar import eos_ids as grammar_eos_ids
from specd_core.runtime.head_formats import aux_layer_ids, head_format, head_method, read_config
from specd_core.runtime.models import context_length, load_tokenizer
from specd_core.runtime.token_text import TokenizerUnsupported


def eos_ids(config) -> set[int]:
    ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


@dataclass
class ModelFacts:
    name: str  # the target directory's name (gen_ai.request.model)
    tokenizer: Any
    # The target's embedding rows (padding included): the ids a prompt may
    # hold and drafters may propose; the verifier checks the same bound.
    vocab_size: int
    target_ctx: int
    drafter_ctx: int
    eos_ids: set[int]
    drafter_method: str  # what the drafter pool serves: eagle | eagle3 | medusa | draft_model
    # Structured output over the target's tokenizer, built at start: a tokenizer
    # it cannot run over is logged once there, and each constrained request is
    # refused with why (FAILED_PRECONDITION).
    built_grammar: GrammarEngine | TokenizerUnsupported = field(repr=False)
    # Method eagle3: the target layers whose states its head reads; () = the
    # last layer's output (eagle).
    feature_layers: tuple[int, ...] = ()

    @property
    def grammar(self) -> GrammarEngine:
        """The grammar engine (specd_core/runtime/grammar.py); TokenizerUnsupported where it cannot run."""
        return engine_of(self.built_grammar)

    @property
    def contexts(self) -> ContextLengths:
        return ContextLengths(self.target_ctx, self.drafter_ctx)


def load_model_facts(config: OrchestratorConfig) -> ModelFacts:
    """The target's facts from its directory, and the drafter's: an EAGLE head
    directory (method eagle, eagle3 or medusa, on the target's features, vocabulary and
    context; refused unless its shapes fit the target) or a draft model,
    refused unless it shares the target's tokenizer."""
    tokenizer = load_tokenizer(config.target_dir)
    target = AutoConfig.from_pretrained(config.target_dir)
    target_ctx = drafter_ctx = context_length(target)
    method = head_method(config.drafter_dir) or "draft_model"
    if config.drafter_dir:
        # A draft model: decided on the tokenizers, not on the embedding rows:
        # padded tables differ in size over the same tokens (specd_core/rules/vocab.py),
        # and the drafter proposes only ids the target has (drafter_svc/vocab.py).
        # A published head: its shapes against the target's (orchestrator/pair.py).
        check_pair(config.target_dir, config.drafter_dir, tokenizer)
    if method == "draft_model" and config.drafter_dir:
        drafter_ctx = context_length(AutoConfig.from_pretrained(config.drafter_dir))
    layers: tuple[int, ...] = ()
    if head_format(config.drafter_dir) == "eagle3":
        layers = aux_layer_ids(read_config(config.drafter_dir), target.num_hidden_layers)
    return ModelFacts(
        name=Path(config.target_dir).name,
        tokenizer=tokenizer,
        vocab_size=target.vocab_size,
        target_ctx=target_ctx,
        drafter_ctx=drafter_ctx,
        eos_ids=eos_ids(target),
        drafter_method=method,
        built_grammar=try_engine(tokenizer, grammar_eos_ids(target, tokenizer)),
        feature_layers=layers,
    )


def check_speculation(config: OrchestratorConfig, model: ModelFacts, has_drafter: bool) -> None:
    """The configured speculative method needs a drafter replica, of the kind
    the drafter directory is."""
    sc = config.speculative
    if sc.method in DRAFTER_METHODS and sc.num_speculative_tokens and not has_drafter:
        raise ValueError(f"speculative_config.method is {sc.method} but no drafter replica is deployed")
    if sc.method in DRAFTER_METHODS and config.drafter_dir and sc.method != model.drafter_method:
        raise ValueError(
            f"speculative_config.method is {sc.method} but the drafter {config.drafter_dir} "
            f"is for {model.drafter_method}"
        )
