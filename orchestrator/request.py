"""GenerateRequest validation: proto in, a checked `GenerationSpec` out.

Every rejection is an InvalidRequest whose message names the field and value, so
the client sees INVALID_ARGUMENT with a reason and no service state is touched.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from specd.draft_shape import DraftShape
from specd.errors import InvalidRequest
from specd.sampling import SamplingParams
from specd.validation import check_token_ids

from .config import OrchestratorConfig


@dataclass(frozen=True)
class GenerationSpec:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    shape: DraftShape | None      # the draft each cycle; None = plain decoding
    stop: tuple[str, ...] = ()


def build_spec(req, config: OrchestratorConfig, tokenizer, vocab_size: int, context_length: int,
               has_drafter: bool) -> GenerationSpec:
    kind = req.WhichOneof("input")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt must not be empty")
        prompt_ids = tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
    elif kind == "prompt_token_ids":
        prompt_ids = list(req.prompt_token_ids.ids)
    else:
        raise InvalidRequest("give either prompt (text) or prompt_token_ids")
    check_token_ids(prompt_ids, vocab_size, context_length, "prompt")

    max_new = req.max_new_tokens if req.HasField("max_new_tokens") else config.default_max_new_tokens
    if not (1 <= max_new <= config.max_new_tokens_limit):
        raise InvalidRequest(f"max_new_tokens must be in [1, {config.max_new_tokens_limit}], got {max_new}")

    top_p = req.top_p if req.HasField("top_p") else 1.0
    if math.isnan(top_p) or not (0.0 < top_p <= 1.0):  # checked here: 0 would read as "unset" downstream
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    sampling = SamplingParams(req.temperature, top_p, req.top_k, seed).validate()

    if any(not s for s in req.stop):
        raise InvalidRequest("stop strings must not be empty")
    return GenerationSpec(prompt_ids, max_new, sampling, draft_shape(req, config, has_drafter), tuple(req.stop))


def draft_shape(req, config: OrchestratorConfig, has_drafter: bool) -> DraftShape | None:
    """The request's draft: its tree, else a chain of its K, else the service
    default; None = speculation off. Bounded by the service's limits."""
    if req.HasField("num_speculative_tokens"):
        k = req.num_speculative_tokens
        if not (0 <= k <= config.max_num_speculative_tokens):
            raise InvalidRequest(
                f"num_speculative_tokens must be in [0, {config.max_num_speculative_tokens}], got {k}")
        if k == 0:
            return None
    if req.HasField("tree"):
        t = req.tree
        shape = DraftShape(branching=tuple(t.branching), node_budget=t.node_budget, max_depth=t.max_depth,
                           top_k=t.top_k or config.default_tree_top_k)
    elif req.HasField("num_speculative_tokens"):
        shape = DraftShape.chain(req.num_speculative_tokens)
    else:
        shape = config.default_shape() if has_drafter else None
    if shape is None:
        return None
    if not has_drafter:
        raise InvalidRequest("speculation was asked for but this deployment has no drafter")
    return shape.validate(config.max_tree_nodes, config.max_num_speculative_tokens)
