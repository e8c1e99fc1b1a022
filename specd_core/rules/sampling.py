"""Turning logits into the distribution a request samples from.

`logits_to_probs` is THE definition of "plain sampling" in specd: the verifier
applies it to the target's logits to get p, the drafter to its own logits to get
q, and speculation-off decoding samples from it directly. Keeping one function is
what makes the acceptance rules exact: p is exactly what target-only sampling
would use. The order (temperature, then top-k, then top-p) is the order of
Hugging Face's TemperatureLogitsWarper / TopKLogitsWarper / TopPLogitsWarper,
checked in tests/test_sampling.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specd_core.errors import InvalidRequest
from specd_core.rules.structured import OutputConstraint

# Below this, logits / temperature can overflow float32 to inf and softmax gives
# NaN; such a request means "greedy", and must say so with temperature = 0.
MIN_TEMPERATURE = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int = 0
    # Structured output (vLLM keeps it with the sampling parameters too): the
    # law is the masked logits' (specd_core/runtime/grammar.py); None = unconstrained.
    constraint: OutputConstraint | None = None
    # Prefix caching (specd_core/runtime/prefix_cache.py): requests share cached
    # KV blocks only with requests of the same salt (tenants apart). It travels
    # with the sampling parameters because every open, resume and rebuild of a
    # session carries them.
    cache_salt: str = ""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        t = self.temperature
        if math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t}")
        if 0 < t < MIN_TEMPERATURE:
            raise InvalidRequest(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}")
        if math.isnan(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.constraint is not None:
            self.constraint.validate()
        return self


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature/top-k/top-p.

    Greedy requests get a one-hot at the argmax, so "p" is well defined for every
    request and the greedy rule is the sampling rule's limit.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # Keep the smallest set whose mass reaches top_p (HF semantics: remove the
        # ascending-sorted tokens whose cumulative mass is <= 1 - top_p).
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a (V,) distribution. The draw happens where the
    generator lives (sessions seed a CPU generator, so that a seed gives the same
    draws on any device): probs on a GPU come over once for it."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def truncate_top(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the n most likely tokens of a (V,) distribution and renormalise.

    Returns (ids, probs) of the truncated distribution: this is what a drafter
    samples from and sends sparsely, so that q on the wire is exactly the q the
    draft token was drawn from (docs/rules.md, "p and q": truncated q stays exact).
    """
    n = min(n, probs.shape[-1])
    vals, ids = torch.topk(probs, n)
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    return ids, vals / vals.sum()
