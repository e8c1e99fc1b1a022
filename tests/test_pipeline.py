"""Pipelined drafting: the drafter drafts cycle n+1 while the verifier
checks cycle n, assuming the whole chain kept and its own guess as the bonus.

- Drafter core: an ahead proposal followed by a rewind leaves the drafter
  exactly where it would be without the ahead call (same next draft, same
  cache length); a confirmed ahead equals an ordinary proposal from the same
  committed tokens; malformed ahead / rewind calls are refused.
- Through the services: greedy streams with pipelining equal target-only
  greedy decoding, and both outcomes (pre-draft used, pre-draft dropped) occur.
- Sampling stays lossless (the exact-joint check of test_sampling_lossless).
"""
import grpc
import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.core import Drafter
from specd_core.errors import InvalidRequest
from specd_core.rules.draft_shape import DraftShape
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.propose_call import ProposeCall
from tests.test_greedy_exact import assert_same_or_near_tie, prompts, reference
from tests.test_sampling_lossless import exact_joint, generate_seeds, null_threshold, tv

GREEDY = SamplingParams()
CHAIN = DraftShape.chain(3)


@pytest.fixture(scope="module", params=["lean", "hf"])
def drafter_pair(request, pairs):
    """Two drafters on the same model: one pipelined, one not."""
    _, drafter_dir = pairs["llama"]
    model = load_model(drafter_dir, "cpu")
    return [Drafter(DrafterConfig(drafter_dir, device="cpu", engine=request.param), model) for _ in range(2)]


def _open_both(drafters, prompt, sid):
    for d in drafters:
        d.open_session(sid, prompt, GREEDY)
    return [d.propose(ProposeCall(sid, [], [prompt[-1] + 1], CHAIN)) for d in drafters]


@pytest.mark.unit
def test_rewound_ahead_leaves_no_trace(drafter_pair):
    plain, piped = drafter_pair
    prompt = [5, 9, 14, 3, 7, 21]
    first, _ = _open_both(drafter_pair, prompt, "rw")
    chain = first.tree.tokens
    ahead = piped.propose(ProposeCall("rw", [0, 1, 2], chain, CHAIN, ahead=True))
    assert ahead.guess is not None and len(ahead.tree.tokens) == 3
    # The verifier kept one token and corrected the second: a miss.
    outcome = ([0], [chain[0], (chain[1] + 1) % 100])
    want = plain.propose(ProposeCall("rw", *outcome, CHAIN))
    got = piped.propose(ProposeCall("rw", *outcome, CHAIN, rewind=True))
    assert got.tree.tokens == want.tree.tokens
    assert piped.sessions["rw"].tokens == plain.sessions["rw"].tokens
    assert piped.sessions["rw"].cache.length == plain.sessions["rw"].cache.length
    # And the cycle after that still agrees (the rolled-back rows were really gone).
    nxt = ([0, 1, 2], got.tree.tokens + [4])
    assert piped.propose(ProposeCall("rw", *nxt, CHAIN)).tree.tokens == plain.propose(ProposeCall("rw", *nxt, CHAIN)).tree.tokens


@pytest.mark.unit
def test_confirmed_ahead_equals_an_ordinary_proposal(drafter_pair):
    plain, piped = drafter_pair
    prompt = [11, 2, 8, 30, 4]
    first, _ = _open_both(drafter_pair, prompt, "ok")
    chain = first.tree.tokens
    ahead = piped.propose(ProposeCall("ok", [0, 1, 2], chain, CHAIN, ahead=True))
    want = plain.propose(ProposeCall("ok", [0, 1, 2], chain + [ahead.guess], CHAIN))
    assert ahead.tree.tokens == want.tree.tokens
    # Confirmed by the next ordinary call (no rewind); it continues from there.
    nxt = ([0], [ahead.tree.tokens[0], 17])
    assert piped.propose(ProposeCall("ok", *nxt, CHAIN)).tree.tokens == plain.propose(ProposeCall("ok", *nxt, CHAIN)).tree.tokens
    assert piped.sessions["ok"].checkpoint is None
    with pytest.raises(InvalidRequest, match="no ahead proposal"):
        piped.prepare(ProposeCall("ok", [], [], CHAIN, rewind=True))


@pytest.mark.unit
def test_malformed_ahead_calls_are_refused(drafter_pair):
    _, piped = drafter_pair
    first = _open_both([piped], [3, 4, 5, 6], "bad")[0]
    chain = first.tree.tokens
    with pytest.raises(InvalidRequest, match="whole last chain"):
        piped.prepare(ProposeCall("bad", [0, 1], chain[:2], CHAIN, ahead=True))
    with pytest.raises(InvalidRequest, match="whole last chain"):
        piped.prepare(ProposeCall("bad", [0, 1, 2], chain + [1], CHAIN, ahead=True))
    with pytest.raises(InvalidRequest, match="only chains"):
        piped.prepare(ProposeCall("bad", [0, 1, 2], chain, DraftShape(branching=(2, 1)), ahead=True))
    with pytest.raises(InvalidRequest, match="no ahead proposal"):
        piped.prepare(ProposeCall("bad", [0, 1, 2], chain + [1], CHAIN, rewind=True))


# ------------------------------------------------- branches (rejection outcomes) --

@pytest.mark.unit
def test_branch_outcomes_and_mask():
    from drafter_svc.branches import alternatives_that_fit, branch_mask, outcomes
    # Chain 7, 8, 9; the drafter's ranked choices where it drafted each (the
    # second was sampled, not its top); bonus guesses 4, 5, 6.
    tops = [[7, 1, 2], [3, 8, 2], [9, 0, 1]]
    assert outcomes([7, 8, 9], tops, [4], 0) == [(3, 4)]
    assert outcomes([7, 8, 9], tops, [4, 5, 6], 1) == [(3, 4), (0, 1), (1, 3), (2, 0), (3, 5)]
    assert outcomes([7, 8, 9], tops[:1], [4, 5, 6], 2) == [(3, 4), (0, 1), (0, 2), (3, 5), (3, 6)]
    # K=3, depth 4: n alternatives make 1 + 4n branches of 4 rows each.
    assert [alternatives_that_fit(2, 3, 4, rows) for rows in (36, 35, 20, 19)] == [2, 1, 1, 0]
    m = branch_mask([2, 4], [[5], [6]], 7)        # rows 7, 8 appended after 7 cached
    assert (m == 0).tolist() == [[True, True, False, False, False, True, False, True, False],
                                 [True, True, True, True, False, False, True, False, True]]


ALTS = 2


def _state(d, sid):
    s = d.sessions[sid]
    return s.tokens, s.cache.length, s.last.tokens


def _same_cache(a, b, sid):
    """Both drafters' KV rows for the session agree (up to float noise: different
    batch shapes round differently)."""
    ca, cb = a.sessions[sid].cache, b.sessions[sid].cache
    assert ca.length == cb.length
    assert torch.allclose(ca.kv[..., :ca.length, :], cb.kv[..., :cb.length, :], atol=1e-4)


@pytest.fixture(scope="module")
def lean_pair(pairs):
    _, drafter_dir = pairs["llama"]
    model = load_model(drafter_dir, "cpu")
    return [Drafter(DrafterConfig(drafter_dir, device="cpu", engine="lean"), model) for _ in range(2)]


@pytest.mark.parametrize("kept", [0, 1, 2, 3])
@pytest.mark.unit
def test_taking_a_branch_equals_a_fresh_draft(lean_pair, kept):
    """Every branch of an ahead call, once taken, leaves the drafter where a
    plain drafter that got that verdict stands: same tokens, same cache rows,
    same last chain, and the cycle after agrees."""
    plain, piped = lean_pair
    sid = f"br{kept}"
    first, _ = _open_both(lean_pair, [8, 3, 19, 4, 25, 6], sid)
    chain = first.tree.tokens
    ahead = piped.propose(ProposeCall(sid, [0, 1, 2], chain, CHAIN, ahead=True, alternatives=ALTS))
    assert len(ahead.branches) == ALTS * 4
    index, branch = next((i + 1, b) for i, b in enumerate(ahead.branches) if b.kept == kept)
    verdict = (list(range(kept)), chain[:kept] + [branch.token])
    want = plain.propose(ProposeCall(sid, *verdict, CHAIN))
    assert branch.tree.tokens == want.tree.tokens
    nxt = ([0], [branch.tree.tokens[0], 5])
    got = piped.propose(ProposeCall(sid, *nxt, CHAIN, branch=index))
    want = plain.propose(ProposeCall(sid, *nxt, CHAIN))
    assert got.tree.tokens == want.tree.tokens
    assert _state(piped, sid) == _state(plain, sid)
    _same_cache(plain, piped, sid)       # the branch's rows were compacted into place, not recomputed


@pytest.mark.unit
def test_branched_ahead_rewinds_and_chains_of_branches(lean_pair):
    """A miss rewinds a branched ahead call to the plain state; a branch taken by
    the next ahead call (pipelining goes on) pre-drafts again from that branch."""
    plain, piped = lean_pair
    sid = "brw"
    first, _ = _open_both(lean_pair, [2, 30, 11, 9], sid)
    chain = first.tree.tokens
    ahead = piped.propose(ProposeCall(sid, [0, 1, 2], chain, CHAIN, ahead=True, alternatives=ALTS))
    miss = [t for t in range(100) if t not in {chain[1]} | {b.token for b in ahead.branches if b.kept == 1}][0]
    verdict = ([0], [chain[0], miss])
    got = piped.propose(ProposeCall(sid, *verdict, CHAIN, rewind=True))
    want = plain.propose(ProposeCall(sid, *verdict, CHAIN))
    assert got.tree.tokens == want.tree.tokens and _state(piped, sid) == _state(plain, sid)
    _same_cache(plain, piped, sid)
    # Ahead again; the verdict is the all-kept branch's 2nd bonus guess, and the
    # next ahead call takes that branch as it goes.
    chain = got.tree.tokens
    ahead = piped.propose(ProposeCall(sid, [0, 1, 2], chain, CHAIN, ahead=True, alternatives=1))
    index, branch = next((i + 1, b) for i, b in enumerate(ahead.branches) if b.kept == 3)
    plain.propose(ProposeCall(sid, [0, 1, 2], chain + [branch.token], CHAIN))
    again = piped.propose(ProposeCall(sid, [0, 1, 2], branch.tree.tokens, CHAIN, ahead=True, alternatives=1, branch=index))
    want = plain.propose(ProposeCall(sid, [0, 1, 2], branch.tree.tokens + [again.guess], CHAIN))
    assert again.tree.tokens == want.tree.tokens
    got = piped.propose(ProposeCall(sid, [0], [again.tree.tokens[0], 1], CHAIN))     # branch 0 by default
    assert got.tree.tokens == plain.propose(ProposeCall(sid, [0], [again.tree.tokens[0], 1], CHAIN)).tree.tokens
    assert _state(piped, sid) == _state(plain, sid)
    _same_cache(plain, piped, sid)


@pytest.mark.unit
def test_malformed_branch_calls_are_refused(lean_pair):
    _, piped = lean_pair
    first = _open_both([piped], [3, 4, 5, 6], "badbr")[0]
    chain = first.tree.tokens
    with pytest.raises(InvalidRequest, match="only for ahead"):
        piped.prepare(ProposeCall("badbr", [0], chain[:1] + [1], CHAIN, alternatives=1))
    with pytest.raises(InvalidRequest, match="outside"):
        piped.prepare(ProposeCall("badbr", [0, 1, 2], chain, CHAIN, ahead=True, alternatives=-1))
    with pytest.raises(InvalidRequest, match="outside"):
        piped.prepare(ProposeCall("badbr", [0, 1, 2], chain, CHAIN, ahead=True, alternatives=99))
    with pytest.raises(InvalidRequest, match="no ahead proposal"):
        piped.prepare(ProposeCall("badbr", [0], chain[:1] + [1], CHAIN, branch=1))
    ahead = piped.propose(ProposeCall("badbr", [0, 1, 2], chain, CHAIN, ahead=True, alternatives=1))
    n = len(ahead.branches) + 1
    with pytest.raises(InvalidRequest, match=f"branches 0..{n - 1}"):
        piped.prepare(ProposeCall("badbr", [0], ahead.tree.tokens[:1] + [1], CHAIN, branch=n))
    with pytest.raises(InvalidRequest, match=f"branches 0..{n - 1}"):
        piped.prepare(ProposeCall("badbr", [0], ahead.tree.tokens[:1] + [1], CHAIN, branch=-1))
    with pytest.raises(InvalidRequest, match="exclude"):
        piped.prepare(ProposeCall("badbr", [0], chain[:1] + [1], CHAIN, branch=1, rewind=True))
    # The outcome is checked against the branch's own chain.
    b = ahead.branches[0]
    with pytest.raises(InvalidRequest, match="committed_token_ids"):
        piped.prepare(ProposeCall("badbr", [0], ahead.tree.tokens[:1] + [1], CHAIN, branch=1))
    piped.prepare(ProposeCall("badbr", [0], b.tree.tokens[:1] + [1], CHAIN, branch=1))


@pytest.mark.unit
def test_hf_engine_makes_only_the_all_kept_branch(drafter_pair):
    _, piped = drafter_pair
    first = _open_both([piped], [7, 7, 2, 40], "hfbr")[0]
    ahead = piped.propose(ProposeCall("hfbr", [0, 1, 2], first.tree.tokens, CHAIN, ahead=True, alternatives=2))
    lean = piped.runner.lean is not None
    assert (len(ahead.branches) == 2 * 4) if lean else not ahead.branches


@pytest.mark.services
def test_pipelined_greedy_equals_target_only(pairs, stacks):
    target_dir, _ = pairs["llama"]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    used = dropped = alternative = 0
    for n, p in enumerate(prompts(tok, 12)):
        want, gaps = reference(model, p)
        for k in (1, 3):
            alts = (n + k) % 3             # 0 = the all-kept branch only
            got, last = stacks["llama"].generate(prompt_token_ids={"ids": p}, max_new_tokens=len(want),
                                                 num_speculative_tokens=k, pipeline_drafting=True,
                                                 pipeline_alternatives=alts)
            assert_same_or_near_tie(got, want, gaps, f"pipelined prompt {n} K={k} alternatives {alts}")
            s = last.stats
            used += s.pipelined_drafts
            dropped += s.drafts - s.pipelined_drafts - 1     # the first draft is never pipelined
            alternative += s.pipelined_alternative_drafts
            assert s.draft_call_ms > 0
            assert alts or not s.pipelined_alternative_drafts
    # Every outcome ran: pre-drafts used (also rejection branches) and dropped.
    assert used > 0 and dropped > 0 and alternative > 0, (used, dropped, alternative)


@pytest.mark.services
def test_by_default_a_lone_stream_pipelines_and_a_shared_drafter_does_not_change_outputs(pairs, stacks):
    """The service's default (pipeline "auto"): a greedy stream alone on its
    drafter pipelines, with no request field asking; a seeded sampled one does
    not (its output must not depend on the load); two streams at once, the
    short one ending first, leave the long one alone for its last cycles, and
    it keeps the target's greedy output through the switch."""
    from concurrent.futures import ThreadPoolExecutor

    target_dir, _ = pairs["llama"]
    model, tok = load_model(target_dir, "cpu"), load_tokenizer(target_dir)
    stack = stacks["llama"]
    q, *rest = prompts(tok, 12)
    # A prompt whose greedy output runs long, for many cycles after the short stream ends.
    for p in rest:
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=64, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        want = out.sequences[0, len(p):].tolist()
        if len(want) == 64:
            break
    gaps = [float(torch.topk(x[0], 2).values.diff().abs()) for x in out.logits]
    got, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=len(want), num_speculative_tokens=3)
    assert_same_or_near_tie(got, want, gaps, "lone stream, default settings")
    assert last.stats.pipelined_drafts > 0 and last.stats.draft_call_ms > 0
    _, last = stack.generate(prompt_token_ids={"ids": p}, max_new_tokens=24, num_speculative_tokens=3,
                             temperature=0.8, seed=5)
    assert last.stats.drafts > 1 and last.stats.pipelined_drafts == 0
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(stack.generate, prompt_token_ids={"ids": p}, max_new_tokens=len(want),
                           num_speculative_tokens=3)
        short = pool.submit(stack.generate, prompt_token_ids={"ids": q}, max_new_tokens=4, num_speculative_tokens=3)
        short.result()
        got, last = long.result()
    assert_same_or_near_tie(got, want, gaps, "two streams, the long one alone at the end")
    assert last.stats.pipelined_drafts > 0


@pytest.mark.services
def test_pipelining_needs_a_drafter_chain(stacks):
    with pytest.raises(grpc.RpcError) as e:
        stacks["llama"].generate(prompt="hello", max_new_tokens=4, speculative_method="ngram",
                                 pipeline_drafting=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft_model" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stacks["llama"].generate(prompt="hello", max_new_tokens=4, tree={"branching": [2, 1]},
                                 pipeline_drafting=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree" in e.value.details()


N = 2000


# One sampling setting per branch mode (the all-kept branch only; 2 alternatives
# per depth, the default): each case costs ~25 s on 2 cores.
@pytest.mark.parametrize("prompt,temperature,top_p,top_k,alternatives",
                         [([40, 41, 42, 43, 44], 1.0, 1.0, 3, 0), ([100, 7, 9], 0.7, 0.8, 0, 2)],
                         ids=["T1k3", "T0.7p0.8-alt2"])
@pytest.mark.services
@pytest.mark.statistical
def test_pipelined_sampling_matches_target(prompt, temperature, top_p, top_k, alternatives, pairs, stacks):
    """Chains of 1: token 1 comes from the prefill, tokens 2-3 from cycle 1, and
    when cycle 1 kept its draft, token 4 from cycle 2, whose draft was made
    ahead: used iff the bonus (token 3) equals the drafter's guess, else
    dropped and redrafted. The joint of the first 4 tokens must be the target's.
    With alternatives, cycle 1's rejection (its correction = the drafter's 2nd
    choice) and 2nd bonus guesses also have pre-drafts that cycle 2 uses."""
    target_dir, drafter_dir = pairs["llama"]
    params = SamplingParams(temperature, top_p, top_k)
    joint = exact_joint(target_dir, prompt, params, length=4)
    counts, used, dropped, alternative = {}, 0, 0, 0
    for ids, last in generate_seeds(
            stacks["llama"], N, prompt_token_ids={"ids": prompt}, max_new_tokens=6, temperature=temperature,
            top_p=top_p, top_k=top_k, num_speculative_tokens=1, pipeline_drafting=True,
            pipeline_alternatives=alternatives):
        counts[tuple(ids[:4])] = counts.get(tuple(ids[:4]), 0) + 1
        used += last.stats.pipelined_drafts > 0
        dropped += last.stats.drafts - last.stats.pipelined_drafts > 1
        alternative += last.stats.pipelined_alternative_drafts > 0
    threshold = null_threshold(joint, N)
    assert used > 0.05 * N and dropped > 0.05 * N, (used, dropped)   # both outcomes are frequent
    assert (alternative > 0.05 * N) if alternatives else not alternative, alternative
    assert tv(joint, counts, N) < threshold, (tv(joint, counts, N), threshold)
    # The threshold must be able to fail: the drafter's own joint is farther away.
    drafter_joint = exact_joint(drafter_dir, prompt, params, length=4)
    assert tv(joint, {k: v * N for k, v in drafter_joint.items()}, N) > threshold
