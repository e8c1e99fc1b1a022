"""Exactness under batching. 16 concurrent streams with
different prompts, lengths and methods (chains of several K, static, path and
dynamic trees, ngram, off, adaptive depth) share verify forwards, and each still equals its
target-only greedy output. The verifier's own metrics show that calls were
really batched (more than one session per forward on average)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specd_core.runtime.models import load_model, load_tokenizer
from tests.test_greedy_exact import assert_same_or_near_tie, prompts
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.services

SETTINGS = [dict(num_speculative_tokens=2), dict(num_speculative_tokens=4), dict(tree={"branching": [2, 1, 1]}),
            dict(tree={"paths": [{"ranks": [0]}, {"ranks": [1]}, {"ranks": [0, 0]}]}),
            dict(tree={"node_budget": 6, "max_depth": 3, "top_k": 2}),
            dict(speculative_method="ngram", num_speculative_tokens=3), dict(num_speculative_tokens=0),
            dict(num_speculative_tokens=1), dict(), dict(adaptive_speculation=True, num_speculative_tokens=5)]


def reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [float(torch.topk(l[0], 2).values.diff().abs())
                                                     for l in out.logits]


def test_sixteen_concurrent_streams_batched_exactly(pairs, metered):
    target_dir, _ = pairs["llama"]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    ps = prompts(tok, 16)
    lengths = [16 + 3 * i for i in range(16)]
    before = scrape(metered.verifier.metrics_address)      # the stack is shared: count the difference
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: metered.generate(
            prompt_token_ids={"ids": ps[i]}, max_new_tokens=lengths[i], **SETTINGS[i % len(SETTINGS)]),
            range(16)))
    for i, (got, last) in enumerate(results):
        want, gaps = reference(model, ps[i], lengths[i])
        assert_same_or_near_tie(got, want, gaps, f"stream {i} {SETTINGS[i % len(SETTINGS)]}")
    methods = {last.stats.method for _, last in results}
    assert methods == {"draft_model", "ngram", "off"}
    # The service default (no K, no tree) is adaptive; a request's own K is fixed unless it asks.
    assert [last.stats.adaptive for _, last in results[:10]] == [False] * 8 + [True, True]
    v = scrape(metered.verifier.metrics_address)
    forwards, sessions = (value(v, f"specdec:verify_batch_size_{k}") - value(before, f"specdec:verify_batch_size_{k}")
                          for k in ("count", "sum"))
    assert sessions == sum(last.stats.cycles for _, last in results)
    # Unbatched serving gives exactly 1.0 here.
    assert sessions / forwards > 1.2, f"{sessions} session-cycles in {forwards} forwards: hardly batched"
