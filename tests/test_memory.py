"""The verifier's memory follows live sessions only. After
1,000 completed streams (8 at a time, varied lengths and methods) its resident
memory is within 10% of what it was after the first 50, and it holds no session
and no KV token."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from specd_core.runtime.models import load_tokenizer
from tests.test_greedy_exact import prompts
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.services


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_verifier_memory_returns_after_1000_streams(pairs, metered):
    tok = load_tokenizer(pairs["llama"][0])
    ps = prompts(tok, 20)
    settings = [dict(num_speculative_tokens=3), dict(tree={"branching": [2, 1]}), dict(num_speculative_tokens=0),
                dict(speculative_method="ngram", num_speculative_tokens=2)]

    def one(i):
        ids, _ = metered.generate(prompt_token_ids={"ids": ps[i % 20]}, max_new_tokens=4 + i % 13,
                                  **settings[i % len(settings)])
        return len(ids)

    pid = metered.verifier.proc.pid
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(50)))
        after_50 = rss_kib(pid)
        assert all(pool.map(one, range(50, 1000)))
    after_1000 = rss_kib(pid)
    v = scrape(metered.verifier.metrics_address)
    assert value(v, "specdec:active_sessions") == 0 and value(v, "specdec:kv_cache_tokens") == 0
    assert after_1000 <= 1.10 * after_50, f"verifier RSS {after_50} KiB after 50 streams, {after_1000} after 1000"
    print(f"verifier RSS: {after_50} KiB after 50 streams, {after_1000} KiB after 1000")
