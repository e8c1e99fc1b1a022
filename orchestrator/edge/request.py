"""GenerateRequest validation: proto in, a checked `GenerationSpec` out.

Every rejection is an InvalidRequest whose message names the field and value, so
the client sees INVALID_ARGUMENT with a reason and no service state is touched.
The edges (gRPC and HTTP) parse here and hand the core the spec
(`spec_for`); the core never reads a proto.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from orchestrator.config import OrchestratorConfig
from orchestrator.core import Orchestrator
from orchestrator.cycle.spec import GenerationSpec
from orchestrator.edge.chat import chat_prompt_ids
from orchestrator.fleet.failover import reseeded
from orchestrator.spec_config import DRAFTER_METHODS, MAX_PIPELINE_ALTERNATIVES, METHODS, SpeculativeConfig
from specd_core.errors import InvalidRequest
from specd_core.net.wire import constraint_from_proto, shape_from_proto
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.rules.structured import OutputConstraint
from specd_core.rules.validation import check_token_ids


def build_spec(
    req,
    config: OrchestratorConfig,
    tokenizer,
    vocab_size: int,
    context_length: int,
    has_drafter: bool,
    drafter_method: str = "draft_model",
    compile_constraint: Callable[[OutputConstraint], object] | None = None,
) -> GenerationSpec:
    """drafter_method: what the deployment's drafter pool serves (draft_model | eagle | eagle3 | medusa).
    compile_constraint: checks a structured_output (InvalidRequest naming
    what is wrong) before any replica sees it."""
    prompt_ids = request_prompt_ids(req, tokenizer)
    check_token_ids(prompt_ids, vocab_size, context_length, "prompt")

    max_new = req.max_new_tokens if req.HasField("max_new_tokens") else config.default_max_new_tokens
    if not (1 <= max_new <= config.max_new_tokens_limit):
        raise InvalidRequest(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {max_new}")

    # An unset top_p is 1 (off); a set one, 0 included, is checked as given.
    top_p = req.top_p if req.HasField("top_p") else 1.0
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    constraint = constraint_from_proto(req.structured_output, req.HasField("structured_output"))
    sampling = SamplingParams(req.temperature, top_p, req.top_k, seed, constraint, req.cache_salt).validate()
    if constraint is not None and compile_constraint is not None:
        compile_constraint(constraint)

    if any(not s for s in req.stop):
        raise InvalidRequest("stop strings must not be empty")
    method, shape = speculation(req, config.speculative, has_drafter, drafter_method)
    if req.HasField("adaptive_speculation"):
        adaptive = req.adaptive_speculation
    else:  # a request that names its own K or tree gets exactly that
        adaptive = config.speculative.adaptive and not (req.HasField("num_speculative_tokens") or req.HasField("tree"))
    pipeline, alone = pipelining(req, config.speculative, method, shape, constraint is not None)
    adaptive = adaptive and shape is not None
    return GenerationSpec(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new,
        sampling=sampling,
        method=method,
        shape=shape,
        stop=tuple(req.stop),
        adaptive=adaptive,
        pipeline=pipeline,
        pipeline_alone=alone,
        pipeline_alternatives=alternatives(req, config.speculative) if pipeline else 0,
        confidence=confidence_threshold(req, config.speculative, method, shape, adaptive),
        forced_room=forced_room(req, config.speculative, constraint is not None),
    )


def spec_for(req, core: Orchestrator) -> GenerationSpec:
    """A request as `core` runs it: checked against its model, its settings
    and what its fleet serves. Lost drafters count: they may be back
    (restarted) before the session needs them, and without one it runs as
    plain decoding anyway."""
    model = core.model
    spec = build_spec(
        req,
        core.config,
        model.tokenizer,
        model.vocab_size,
        model.target_ctx,
        has_drafter=core.fleet.has_drafter(),
        drafter_method=model.drafter_method,
        compile_constraint=lambda c: model.grammar.compile(c),
    )
    if spec.features:  # the layers its head reads (EAGLE-3's auxiliary ones)
        spec = dataclasses.replace(spec, feature_layers=model.feature_layers)
    return resumed(spec, list(req.resume_token_ids), model.vocab_size, model.target_ctx, model.eos_ids)


def resumed(spec: GenerationSpec, ids: list[int], vocab_size: int, context_length: int, eos) -> GenerationSpec:
    """The spec of a resumed request (GenerateRequest.resume_token_ids: the
    tokens its client already received), checked: ids in the vocabulary and
    none an end-of-sequence id (a stream that produced one had ended), no
    more than max_new_tokens, prompt + ids within the target's context. It
    samples from a fresh seed derived from (seed, resumed length), as a
    session rebuilt after a replica loss does: its draws must not be those
    that made the tokens the client has. Whether the constraint allows the
    ids is checked where it is built (Orchestrator._loop)."""
    if not ids:
        return spec
    check_token_ids(ids, vocab_size, None, "resume_token_ids")
    ended = [(i, t) for i, t in enumerate(ids) if t in eos]
    if ended:
        i, t = ended[0]
        raise InvalidRequest(
            f"resume_token_ids[{i}] is {t}, an end-of-sequence id: a stream that produced it had ended "
            "(its last message said so)"
        )
    if len(ids) > spec.max_new_tokens:
        raise InvalidRequest(
            f"resume_token_ids has {len(ids)} tokens, more than max_new_tokens {spec.max_new_tokens} "
            "(resumed tokens count toward it)"
        )
    context = len(spec.prompt_ids) + len(ids)
    if context > context_length:
        raise InvalidRequest(
            f"the prompt ({len(spec.prompt_ids)} tokens) and resume_token_ids ({len(ids)}) hold {context} tokens; "
            f"the model's context is {context_length}"
        )
    return dataclasses.replace(spec, resumed=tuple(ids), sampling=reseeded(spec.sampling, context))


def forced_room(req, sc: SpeculativeConfig, constrained: bool) -> int:
    """Draft depth that forced tokens may fill (0: no forced drafting)."""
    if req.HasField("forced_drafting") and not constrained:
        raise InvalidRequest("forced_drafting is for requests with structured_output")
    on = req.forced_drafting if req.HasField("forced_drafting") else True
    return sc.max_num_speculative_tokens if constrained and on else 0


def request_prompt_ids(req, tokenizer) -> list[int]:
    """The prompt of a request, from its one input: text (tokenised without
    special tokens: the text is the whole prompt), ids, or chat messages."""
    kind = req.WhichOneof("input")
    if kind and req.messages:
        raise InvalidRequest(f"give one input: {kind} or messages, not both")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt must not be empty")
        return tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
    if kind == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    if req.messages:
        return chat_prompt_ids(tokenizer, [(m.role, m.content) for m in req.messages])
    raise InvalidRequest(
        "give either prompt (text), prompt_token_ids or messages (a chat); "
        "the request has none (an empty messages list counts as none)"
    )


def alternatives(req, sc: SpeculativeConfig) -> int:
    """Rejection outcomes pre-drafted per depth (pipelined drafting)."""
    if not req.HasField("pipeline_alternatives"):
        return sc.pipeline_alternatives
    n = req.pipeline_alternatives
    if not 0 <= n <= MAX_PIPELINE_ALTERNATIVES:
        raise InvalidRequest(f"pipeline_alternatives must be in [0, {MAX_PIPELINE_ALTERNATIVES}], got {n}")
    return n


def confidence_threshold(
    req, sc: SpeculativeConfig, method: str, shape: DraftShape | None, adaptive: bool
) -> float | None:
    """The drafter's stopping threshold (None: learned per cycle). Only a
    drafter service reports confidences; other methods draft as they do."""
    drafts = method in DRAFTER_METHODS and shape is not None
    if req.HasField("confidence_threshold"):
        t = req.confidence_threshold
        if not 0.0 <= t < 1.0:  # NaN fails too
            raise InvalidRequest(f"confidence_threshold must be in [0, 1) (0 = off), got {t}")
        if t and not drafts:
            raise InvalidRequest(
                f"confidence_threshold needs speculative_method {', '.join(DRAFTER_METHODS)} (got method {method!r})"
            )
        return t
    if not drafts:
        return 0.0
    if sc.confidence_threshold == "auto":
        return None if adaptive else 0.0
    return float(sc.confidence_threshold)


def pipelining(
    req, sc: SpeculativeConfig, method: str, shape: DraftShape | None, constrained: bool = False
) -> tuple[bool, bool]:
    """(pipelined, only while alone on its drafter). Pipelined drafting needs a
    drafter service drafting chains: the drafter guesses the bonus token after
    the last chain token, a single position. Not with structured output: the
    guess would advance the constraint on a token nobody committed. The
    service's "auto" leaves out a sampled request with a seed of its own: the
    drafts, and so the seed's output, would depend on the load."""
    able = method == "draft_model" and shape is not None and shape.is_chain
    if req.HasField("pipeline_drafting"):
        if req.pipeline_drafting and constrained:
            raise InvalidRequest("pipeline_drafting is not available with structured_output")
        if req.pipeline_drafting and not able:
            raise InvalidRequest(
                "pipeline_drafting needs speculative_method draft_model with a chain "
                f"(got method {method!r}{' and a tree' if shape is not None and not shape.is_chain else ''})"
            )
        return req.pipeline_drafting, False
    if sc.pipeline == "auto":
        seeded = req.temperature > 0 and req.HasField("seed")
        return able and not constrained and not seeded, True
    return bool(sc.pipeline) and able and not constrained, False


def speculation(
    req, sc: SpeculativeConfig, has_drafter: bool, drafter_method: str = "draft_model"
) -> tuple[str, DraftShape | None]:
    """(method, draft shape) for a request: its own method / K / tree where it
    sets them, else the service's speculative config, within the service's limits."""
    method = req.speculative_method or sc.method
    if method not in METHODS:
        raise InvalidRequest(f"speculative_method must be one of {', '.join(METHODS)} (or empty), got {method!r}")
    k = sc.num_speculative_tokens
    if req.HasField("num_speculative_tokens"):
        k = req.num_speculative_tokens
        if not (0 <= k <= sc.max_num_speculative_tokens):
            raise InvalidRequest(f"num_speculative_tokens must be in [0, {sc.max_num_speculative_tokens}], got {k}")
    if req.HasField("tree") and method not in DRAFTER_METHODS:
        raise InvalidRequest(f"a draft tree needs speculative_method {', '.join(DRAFTER_METHODS)}, not {method!r}")
    if method == "off" or k == 0:
        return "off", None
    if method == "ngram":
        return method, DraftShape.chain(k)
    if not has_drafter:
        if req.speculative_method or req.HasField("num_speculative_tokens") or req.HasField("tree"):
            raise InvalidRequest("speculative_method draft_model was asked for but this deployment has no drafter")
        return "off", None
    if method != drafter_method:
        raise InvalidRequest(
            f"speculative_method {method} was asked for but this deployment's drafter serves {drafter_method}"
        )
    if req.HasField("tree"):
        if req.tree.min_confidence:
            raise InvalidRequest("tree.min_confidence: a request sets it with confidence_threshold")
        shape = shape_from_proto(req.tree)
    elif sc.tree and not req.HasField("num_speculative_tokens"):
        shape = sc.tree_shape()
    else:
        shape = DraftShape.chain(k)
    return method, shape.validate(sc.max_tree_nodes, sc.max_num_speculative_tokens)
