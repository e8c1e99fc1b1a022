"""Greedy structured output through the real services equals target-only
constrained greedy decoding: at every step the argmax of the target's logits
with every token the constraint forbids at -inf, until EOS. For a JSON
schema, a regex and a GBNF grammar, on two model families, with speculation
off, chains (forced drafting on and off), a static tree, a dynamic tree and
n-gram drafting.

The reference is computed here from the model and llguidance alone (a
matcher fed the output so far), not through specd's grammar module. As in
tests/test_greedy_exact.py, a divergence is tolerated only at a numerical
near-tie of the reference's two best allowed tokens.
"""
import json

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import NEAR_TIE
from tests.tiny_models import corpus_lines

pytestmark = pytest.mark.services

MAX_NEW = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "regex": {"regex": "(def|class) [a-z_]{1,12}\\((self)?\\):"},
    "ebnf": {"ebnf": 'root ::= "x = " value\nvalue ::= [0-9]{1,4} | "None" | "[" [0-9] ("," [0-9])* "]"'},
}
METHODS = {
    "off": dict(speculative_method="off"),
    "chain3": dict(num_speculative_tokens=3),
    "chain3-no-forced": dict(num_speculative_tokens=3, forced_drafting=False),
    "static-tree": dict(tree={"branching": [2, 2, 1]}),
    "dynamic-tree": dict(tree={"node_budget": 6, "max_depth": 3, "top_k": 2}),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4),
}


def grammar_of(kind: str, text: str) -> str:
    if kind == "json_schema":
        # specd compiles JSON without free whitespace (docs/structured.md)
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    from llguidance.gbnf_to_lark import any_to_lark
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))


@torch.inference_mode()
def constrained_greedy(model, lltok, grammar: str, prompt: list[int], eos: int,
                       max_new: int = MAX_NEW) -> tuple[list[int], list[float]]:
    """Target-only constrained greedy, and the top-2 gap among allowed tokens per step."""
    m = llguidance.LLMatcher(lltok, grammar)
    out, gaps = [], []
    for _ in range(max_new):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        n = min(len(bits), logits.shape[0])
        allowed[:n] = torch.from_numpy(bits[:n])
        masked = logits.masked_fill(~allowed, float("-inf"))
        top = torch.topk(masked, 2).values
        gaps.append(float(top[0] - top[1]) if torch.isfinite(top[1]) else float("inf"))
        t = int(masked.argmax())
        out.append(t)
        if t == eos:
            break
        assert m.consume_token(t), m.get_error()
    return out, gaps


def prompts(tokenizer, n=3):
    lines = [line for line in corpus_lines() if len(line.strip()) > 30]
    return [tokenizer(lines[i * 97])["input_ids"] for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_constrained_greedy_equals_target_only(family, pairs, stacks):
    target_dir, _ = pairs[family]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    lltok = llguidance.hf.from_tokenizer(tok)
    stack = stacks[family]
    drafted = forced = finished = 0
    for kind, field in CONSTRAINTS.items():
        grammar = grammar_of(kind, next(iter(field.values())))
        for n, prompt in enumerate(prompts(tok)):
            want, gaps = constrained_greedy(model, lltok, grammar, prompt, tok.eos_token_id)
            finished += want[-1] == tok.eos_token_id
            for name, fields in METHODS.items():
                got, last = stack.generate(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW,
                                           structured_output=field, **fields)
                where = f"{family} {kind} prompt {n} {name}"
                diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                if diverged is not None:
                    assert gaps[diverged] < NEAR_TIE, f"{where}: diverged at {diverged}, gap {gaps[diverged]:.2e}"
                else:
                    assert got == want, f"{where}: {len(got)} tokens, want {len(want)}"
                    assert last.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length"), where
                drafted += last.stats.drafted_tokens
                forced += last.stats.forced_tokens
                if name == "chain3-no-forced":
                    assert last.stats.forced_tokens == 0, where
    # Meaningful only if drafts ran, forced tokens among them, and outputs ended inside the grammar.
    assert drafted > 0 and forced > 0 and finished > 0
