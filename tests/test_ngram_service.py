"""The ngram method through the real services: greedy exactness, lossless sampling,
and per-request method override on one running system."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specd_core.rules.sampling import SamplingParams, logits_to_probs
from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import MAX_NEW, assert_same_or_near_tie, prompts, reference
from tests.test_sampling_lossless import N, check_stream_law, exact_joint, null_threshold


def repetitive_prompts(tok, n=20):
    """Code lines said twice: what a prompt-lookup draft can find."""
    return [p + p[: len(p) // 2] for p in prompts(tok, n)]


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.services
def test_ngram_greedy_equals_target_only(k, pairs, stacks):
    target_dir, _ = pairs["llama"]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    accepted = drafted = 0
    for n, p in enumerate(repetitive_prompts(tok)):
        want, gaps = reference(model, p)
        got, last = stacks["llama"].generate(prompt_token_ids={"ids": p}, max_new_tokens=MAX_NEW,
                                             speculative_method="ngram", num_speculative_tokens=k)
        assert_same_or_near_tie(got, want, gaps, f"ngram K={k} prompt {n}")
        assert last.stats.method == "ngram"
        accepted += last.stats.accepted_tokens
        drafted += last.stats.drafted_tokens
    assert 0 < accepted < drafted      # drafts were found, some kept, some not


@torch.inference_mode()
def lookup_prompt(model, params: SamplingParams) -> list[int]:
    """A prompt (the model's own greedy text, repeated) after which the first
    sampled token very likely occurred earlier in the prompt, so that prompt
    lookup has drafts to propose: chosen by a small deterministic search."""
    best = (-1.0, [])
    for s in range(30):
        seed = [40 + s, 41 + s]
        g = model.generate(torch.tensor([seed]), do_sample=False, max_new_tokens=12, pad_token_id=0)[0, 2:].tolist()
        for prompt in (seed + g, seed + g + g[:2], seed + g + seed):
            p = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)
            mass = float(p[list(set(prompt[:-1]))].sum())
            best = max(best, (mass, prompt))
    return best[1]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 6), (0.7, 0.8, 0)])
@pytest.mark.services
@pytest.mark.statistical
def test_ngram_sampling_matches_target(temperature, top_p, top_k, pairs, stacks):
    """Point-mass drafts (the deterministic rule) leave the target law intact."""
    target_dir, _ = pairs["llama"]
    params = SamplingParams(temperature, top_p, top_k)
    prompt = lookup_prompt(load_model(target_dir, "cpu"), params)
    joint = exact_joint(target_dir, prompt, params)
    check_stream_law(stacks["llama"], prompt, joint, null_threshold(joint, N),
                     dict(speculative_method="ngram", num_speculative_tokens=2, temperature=temperature,
                          top_p=top_p, top_k=top_k))


@pytest.mark.services
def test_per_request_methods_concurrently(pairs, stacks):
    """off, ngram and draft_model served at once by the same system; each final
    stats message names its method; greedy outputs are identical."""
    target_dir, _ = pairs["llama"]
    tok = load_tokenizer(target_dir)
    methods = ["off", "ngram", "draft_model"] * 3
    ps = repetitive_prompts(tok, 3)
    jobs = [(m, ps[i // 3]) for i, m in enumerate(methods)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: stacks["llama"].generate(
            prompt_token_ids={"ids": j[1]}, max_new_tokens=MAX_NEW, speculative_method=j[0]), jobs))
    drafted = dict.fromkeys(set(methods), 0)
    for (method, _), (_, last) in zip(jobs, results):
        assert last.stats.method == method
        drafted[method] += last.stats.drafted_tokens
    # Off drafts nothing; the two speculative methods really drafted.
    assert drafted["off"] == 0 and drafted["ngram"] > 0 and drafted["draft_model"] > 0
    for i in range(0, len(jobs), 3):
        off, ngram, draft = (results[i + j][0] for j in range(3))
        assert off == ngram == draft
