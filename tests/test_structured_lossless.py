"""Structured output keeps speculative sampling exact: through the real
services, the first 3 tokens of constrained requests follow the exact
constrained joint law - the target's logits with every token the constraint
forbids at -inf, then temperature / top-k, at every position.

The reference masks with llguidance directly (a matcher per prefix, from the
constraint's grammar), not through specd's Constraint class, and the law test
is tests/test_sampling_lossless.py's (N seeded requests, total-variation
distance against the 99.9th percentile of its null distribution). Cases:
chains and a static tree of sampled children, under a regex whose allowed
tokens depend on the state (letters counted per word) and one with forced
tokens (`if` is followed by a forced space, drafted for free).

Power: the unmasked joint is far outside the threshold (a verifier that
ignored the constraint would fail; run as a real system, such a verifier
measured 8.6 x the threshold once, tests/README.md), and a subtly wrong
system runs the same test and must fail it (tests/wrong_variants/sitecustomize.py):
matchers advanced on rejected draft tokens.
"""
import os
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from specd.local_stack import Stack
from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_sampling_lossless import N, check_stream_law, null_threshold, stream_law, tv

pytestmark = [pytest.mark.services, pytest.mark.statistical]

PROMPT = [40, 41, 42, 43, 44]
WORDS = "[a-z]{1,3}( [a-z]{1,3})*"  # the mask depends on the letters so far
FORCED = "[a-z]{2}\\(\\)"  # after two letters `(` then `)`: the drafter drafts `(`, `)` is forced
VARIANTS = Path(__file__).parent / "wrong_variants"


def allowed(tokenizer, grammar: str, prefix: tuple, width: int) -> torch.Tensor:
    m = llguidance.LLMatcher(tokenizer, grammar)
    assert m.consume_tokens(list(prefix)), m.get_error()
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)
    out = torch.zeros(width, dtype=torch.bool)
    n = min(width, bits.shape[0])
    out[:n] = torch.from_numpy(bits[:n])
    return out


@torch.inference_mode()
def constrained_joint(model_dir, prompt, params: SamplingParams, regex: str | None, length=3, eps=1e-7) -> dict:
    """The exact joint law of the first `length` tokens; regex None: unconstrained.
    A stream ends at EOS (the constraint allows it where the regex can end), so
    a sequence that reached EOS is kept as it is, shorter."""
    model = load_model(model_dir, "cpu")
    hf_tok = load_tokenizer(model_dir)
    tok = llguidance.hf.from_tokenizer(hf_tok)
    grammar = llguidance.LLMatcher.grammar_from_regex(regex) if regex else None
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {p: v for p, v in joint.items() if p and p[-1] == hf_tok.eos_token_id}
        prefixes = [p for p in joint if p not in nxt]
        logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].clone()
        if grammar is not None:
            for r, prefix in enumerate(prefixes):
                logits[r][~allowed(tok, grammar, prefix, logits.shape[1])] = float("-inf")
        for prefix, row in zip(prefixes, logits_to_probs(logits, params)):
            for t in torch.nonzero(row > eps).flatten().tolist():
                nxt[prefix + (t,)] = joint[prefix] * float(row[t])
        joint = nxt
    return joint


def law(pairs, regex, params):
    target_dir, _ = pairs["llama"]
    joint = constrained_joint(target_dir, PROMPT, params, regex)
    threshold = null_threshold(joint, N)
    # Power: what the target samples without the constraint is far outside.
    unmasked = constrained_joint(target_dir, PROMPT, params, None)
    assert tv(joint, {k: v * N for k, v in unmasked.items()}, N) > 2 * threshold
    return joint, threshold


def fields(regex, temperature, top_p, top_k, draft):
    return dict(temperature=temperature, top_p=top_p, top_k=top_k, structured_output={"regex": regex}, **draft)


CASES = [
    (WORDS, 1.0, 1.0, 6, dict(num_speculative_tokens=2)),
    (FORCED, 1.0, 1.0, 6, dict(num_speculative_tokens=1)),
    (WORDS, 0.7, 0.8, 0, dict(tree={"branching": [2, 2]})),
]


@pytest.mark.parametrize("regex,temperature,top_p,top_k,draft", CASES,
                         ids=["chain-words", "chain-forced", "static22-words-T0.7p0.8"])
def test_constrained_sampling_matches_the_constrained_target(regex, temperature, top_p, top_k, draft, pairs, stacks):
    joint, threshold = law(pairs, regex, SamplingParams(temperature, top_p, top_k))
    forced = check_stream_law(stacks["llama"], PROMPT, joint, threshold,
                              fields(regex, temperature, top_p, top_k, draft))
    if regex == FORCED:  # the forced path really ran
        assert forced > N // 10, f"forced tokens were drafted in {forced} of {N} requests"


def test_a_wrong_rule_fails_the_same_test(pairs):
    variant = "advance_on_rejected"
    target_dir, drafter_dir = pairs["llama"]
    regex, temperature, top_p, top_k, draft = CASES[0]
    joint, threshold = law(pairs, regex, SamplingParams(temperature, top_p, top_k))
    env = {"SPECD_WRONG_VARIANT": variant,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(VARIANTS), os.environ.get("PYTHONPATH")]))}
    # A fresh stack's first sessions compile their grammars: on a loaded CI
    # machine an OpenSession has outlasted the default 5 s hang floor, and a
    # slow answer is not what this test is about.
    stack = Stack(target_dir, drafter_dir, env=env, orchestrator_args=("--hang-floor", "60", "--hang-ceiling", "120"))
    try:
        stat, rejections, _, _ = stream_law(stack, PROMPT, joint, threshold,
                                            fields(regex, temperature, top_p, top_k, draft))
    finally:
        stack.stop()
    assert rejections > N // 10  # the broken path really ran
    assert stat > threshold, f"{variant}: TV {stat:.4f} is inside the threshold {threshold:.4f}"
