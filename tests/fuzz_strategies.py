"""Hypothesis strategies for specd's wire messages (tests/test_fuzz_rpc.py).

Two kinds: `message_strategy(cls)` builds ANY message of a proto class from its
descriptor (every field random or unset, edge values favoured), and targeted
strategies that build nearly valid calls and then break one thing (a tree with a
cycle, a q with a NaN, ...), so the fuzzer also reaches the checks that sit
behind the easy ones."""
from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from specd_core.api.v1 import specdec_pb2 as pb
from tests.tiny_models import VOCAB

I32 = (-2**31, 2**31 - 1)
INT_EDGES = [0, 1, -1, 2, 16, 17, 64, 65, VOCAB - 1, VOCAB, VOCAB + 1, 255, 256, 2**31 - 1, -2**31]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e-3, 1.0000001, 3.4e38, math.nan, math.inf, -math.inf]
SESSION_IDS = ["", " ", "x" * 100_000, "\x00", "séance-☃", "nope"]

int32s = st.one_of(st.sampled_from(INT_EDGES), st.integers(-3, 70), st.integers(*I32))
uint64s = st.one_of(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
float32s = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
texts = st.one_of(st.sampled_from(SESSION_IDS), st.text(max_size=30))
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), st.sampled_from(INT_EDGES))


def _scalar(field: F, depth: int):
    t = field.type
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32, F.TYPE_INT64, F.TYPE_SINT64):
        return int32s
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32, F.TYPE_UINT64, F.TYPE_FIXED64):
        return uint64s
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return float32s
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return texts
    if t == F.TYPE_BYTES:      # e.g. HiddenStates.data: any length, odd sizes included
        return st.binary(max_size=600)
    if t == F.TYPE_MESSAGE:
        return message_strategy(GetMessageClass(field.message_type), depth + 1)
    raise NotImplementedError(f"no strategy for field {field.full_name}")


def message_strategy(cls, depth: int = 0):
    """Any message of `cls`: each field unset or random (repeated: up to 8
    values, or a long list now and then); nested messages up to depth 3."""
    fields = {}
    for f in cls.DESCRIPTOR.fields:
        if f.type == F.TYPE_MESSAGE and depth >= 3:
            continue
        value = _scalar(f, depth)
        if f.is_repeated:
            value = st.one_of(st.lists(value, max_size=8), st.lists(value, min_size=60, max_size=120))
        fields[f.name] = st.none() | value

    def build(values: dict):
        msg = cls()
        for name, v in values.items():
            if v is None:
                continue
            f = cls.DESCRIPTOR.fields_by_name[name]
            if f.is_repeated:
                getattr(msg, name).extend(v)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg
    return st.fixed_dictionaries(fields).map(build)


# ------------------------------------------------------------ targeted parts --

@st.composite
def sampling_params(draw):
    """Mostly valid (greedy or sampled), sometimes one bad field."""
    sp = pb.SamplingParams(temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 2.5])),
                           top_p=draw(st.sampled_from([0.0, 1.0, 0.9, 0.5])),
                           top_k=draw(st.sampled_from([0, 0, 1, 5, VOCAB, VOCAB + 7, 2**31 - 1])),
                           seed=draw(uint64s))
    bad = draw(st.sampled_from([None, None, "temperature", "top_p", "top_k"]))
    if bad == "temperature":
        sp.temperature = draw(st.sampled_from([math.nan, math.inf, -1.0, 1e-30, 3.4e38]))
    elif bad == "top_p":
        sp.top_p = draw(st.sampled_from([math.nan, -0.5, 1.5, math.inf]))
    elif bad == "top_k":
        sp.top_k = draw(st.sampled_from([-1, -2**31]))
    return sp


@st.composite
def prompts(draw):
    """Token prompts: short valid ones mostly; empty, over the context, or with ids
    outside the vocabulary (negative, huge) sometimes."""
    kind = draw(st.sampled_from(["ok", "ok", "ok", "empty", "long", "bad_id"]))
    if kind == "empty":
        return []
    if kind == "long":
        return [7] * draw(st.sampled_from([255, 256, 300, 5000]))
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    if kind == "bad_id":
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, VOCAB, 2**31 - 1, -2**31]))
    return ids


def _children(parents: list[int]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, a in enumerate(parents):
        if -1 <= a < len(parents):
            out[a + 1].append(i)
    return out


@st.composite
def distribution(draw, must_hold: list[int]):
    """A valid sparse q holding `must_hold` (the row's drafted children) plus others."""
    extra = draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
    ids = list(dict.fromkeys(must_hold + extra))
    weights = [draw(st.floats(0.05, 1.0)) for _ in ids]
    total = sum(weights)
    return ids, [w / total for w in weights]


DIST_BREAKS = ["nan", "inf", "negative", "not_one", "duplicate", "out_of_vocab", "huge_id", "len_mismatch",
               "rows_short", "rows_long", "childless_garbage", "zero_for_drafted", "empty_row"]
TREE_BREAKS = ["cycle_self", "cycle_forward", "parent_low", "parent_high", "wrong_len", "too_many",
               "too_deep", "dup_sibling", "bad_token", "huge_token", "negative_token"]


@st.composite
def drafts(draw):
    """(tokens, parents, row dists or None): a valid chain or tree with or without
    a valid q, then maybe one break (TREE_BREAKS, DIST_BREAKS)."""
    n = draw(st.integers(0, 6))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n, unique=True))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)] if draw(st.booleans()) else list(range(-1, n - 1))
    kids = _children(parents)
    dists = [draw(distribution([tokens[c] for c in kids[r]])) if kids[r] else ([], []) for r in range(n + 1)] \
        if draw(st.booleans()) else None
    brk = draw(st.sampled_from([None] + TREE_BREAKS + (DIST_BREAKS if dists else [])))
    if brk and n == 0 and brk not in ("too_many", "too_deep", "rows_long", "wrong_len"):
        brk = None
    i = draw(st.integers(0, max(n - 1, 0)))
    if brk == "cycle_self":
        parents[i] = i
    elif brk == "cycle_forward":          # i's parent comes after i: with the reverse link, a cycle
        parents[i] = min(i + 1, n - 1) if n > 1 else 0
        if n > 1 and i + 1 < n:
            parents[i + 1] = i
    elif brk == "parent_low":
        parents[i] = draw(st.sampled_from([-2, -2**31]))
    elif brk == "parent_high":
        parents[i] = draw(st.sampled_from([n, n + 5, 2**31 - 1]))
    elif brk == "wrong_len":
        parents = parents + [-1] if draw(st.booleans()) else parents[:-1]
    elif brk == "too_many":
        m = draw(st.sampled_from([65, 200, 5000]))
        tokens, parents = [t % VOCAB for t in range(m)], [-1] * m
    elif brk == "too_deep":
        tokens, parents = [5] * 17, list(range(-1, 16))
    elif brk == "dup_sibling" and n > 1:
        tokens[1], parents[1] = tokens[0], parents[0]
    elif brk == "bad_token":
        tokens[i] = VOCAB
    elif brk == "huge_token":
        tokens[i] = 2**31 - 1
    elif brk == "negative_token":
        tokens[i] = draw(st.sampled_from([-1, -2**31]))
    elif dists is not None and brk:
        rows_with = [r for r in range(len(dists)) if dists[r][0]] or [0]
        r = draw(st.sampled_from(rows_with))
        ids, probs = list(dists[r][0]), list(dists[r][1])
        if brk == "nan" and probs:
            probs[0] = math.nan
        elif brk == "inf" and probs:
            probs[0] = math.inf
        elif brk == "negative" and probs:
            probs[0] = -probs[0]
        elif brk == "not_one":
            probs = [p * 0.5 for p in probs]
        elif brk == "duplicate" and ids:
            # The same id twice, the probs still summing to 1.
            ids, probs = ids + [ids[0]], [p * 0.5 for p in probs] + [0.5]
        elif brk == "out_of_vocab":
            ids, probs = ids + [VOCAB + 3], probs[:-1] + [probs[-1] / 2, probs[-1] / 2] if probs else [1.0]
        elif brk == "huge_id":
            ids, probs = ids + [2**31 - 1], [p * 0.5 for p in probs] + [0.5]
        elif brk == "len_mismatch":
            probs = probs + [0.0]
        elif brk == "rows_short":
            dists = dists[:-1]
        elif brk == "rows_long":
            dists = dists + [([1], [1.0])]
        elif brk == "childless_garbage":
            # A row without children may be empty; here it carries a broken q.
            leafless = [k for k in range(len(dists)) if not dists[k][0]]
            if leafless:
                r, ids, probs = leafless[0], [VOCAB + 1, -5], [math.nan, -1.0]
        elif brk == "zero_for_drafted" and ids:
            ids, probs = ids[1:] + [(ids[0] + 1) % VOCAB], probs
        elif brk == "empty_row":
            ids, probs = [], []
        if brk not in ("rows_short", "rows_long"):
            dists[r] = (ids, probs)
    return tokens, parents, dists


@st.composite
def shapes(draw):
    """DraftShape messages: valid chains / static / path / dynamic trees, or broken ones."""
    kind = draw(st.sampled_from(["branching", "paths", "dynamic", "dynamic", "mixed", "random"]))
    if kind == "random":
        return draw(message_strategy(pb.DraftShape))
    shape = pb.DraftShape()
    if kind in ("branching", "mixed"):
        shape.branching.extend(draw(st.lists(st.sampled_from([1, 1, 2, 3, 0, -1, 64, 2**31 - 1]),
                                             min_size=0, max_size=5)))
    if kind in ("paths", "mixed"):
        paths = draw(st.lists(st.lists(st.sampled_from([0, 0, 1, 2, -1, 63, 2**31 - 1]), min_size=0, max_size=4),
                              max_size=8))
        shape.paths.extend(pb.TreePath(ranks=p) for p in paths)
    if kind in ("dynamic", "mixed"):
        shape.node_budget = draw(st.sampled_from([1, 6, 64, 6, 65, 0, -1, 2**31 - 1]))
        shape.max_depth = draw(st.sampled_from([1, 3, 16, 3, 17, 0, -1]))
        shape.top_k = draw(st.sampled_from([0, 1, 4, -1, 20, 64, 65, VOCAB - 1, VOCAB, VOCAB + 1, 10**9]))
    return shape


GENERATE_BREAKS = ["prompt", "text", "max_new_tokens", "sampling", "top_p", "stop", "k", "tree", "method"]


@st.composite
def generate_requests(draw):
    """A valid short GenerateRequest (greedy or sampled, chain, tree, ngram or
    off), then maybe one field broken (GENERATE_BREAKS) or the tree fuzzed."""
    req = pb.GenerateRequest(max_new_tokens=draw(st.integers(1, 10)), seed=draw(uint64s))
    req.prompt_token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)))
    if draw(st.booleans()):
        req.temperature, req.top_k = draw(st.sampled_from([0.7, 1.0, 2.5])), draw(st.sampled_from([0, 5, VOCAB + 7]))
        req.top_p = draw(st.sampled_from([0.9, 1.0, 1e-30]))
    spec = draw(st.sampled_from(["default", "k", "tree", "ngram", "off"]))
    if spec == "k":
        req.num_speculative_tokens = draw(st.sampled_from([0, 1, 3, 16]))
    elif spec == "tree":
        req.tree.CopyFrom(draw(st.sampled_from([pb.DraftShape(branching=[2, 1]), pb.DraftShape(
            node_budget=6, max_depth=3, top_k=draw(st.sampled_from([0, 1, 4, VOCAB, VOCAB + 1, 10**9]))),
            pb.DraftShape(paths=[pb.TreePath(ranks=[0]), pb.TreePath(ranks=[1]), pb.TreePath(ranks=[0, 0])])])))
    elif spec in ("ngram", "off"):
        req.speculative_method = spec
    if draw(st.booleans()):
        req.adaptive_speculation = draw(st.booleans())
    brk = draw(st.sampled_from([None, None, None] + GENERATE_BREAKS))
    if brk == "prompt":
        req.prompt_token_ids.ids[:] = draw(prompts())
    elif brk == "text":
        req.prompt = draw(st.one_of(st.text(max_size=40), st.sampled_from(["", "def f(x):", "\x00", "é" * 400])))
    elif brk == "max_new_tokens":
        req.max_new_tokens = draw(st.sampled_from([0, -1, 4097, 2**31 - 1, -2**31]))
    elif brk == "sampling":
        sp = draw(sampling_params())
        req.temperature, req.top_k = sp.temperature, sp.top_k
    elif brk == "top_p":
        req.top_p = draw(st.sampled_from([0.0, -1.0, 1.5, math.nan, math.inf]))
    elif brk == "stop":
        req.stop.extend(draw(st.lists(st.sampled_from(["\n", "", "x", "é", "\x00", "a" * 1000]), max_size=3)))
    elif brk == "k":
        req.num_speculative_tokens = draw(st.sampled_from([17, -1, 2**31 - 1, -2**31]))
    elif brk == "tree":
        req.tree.CopyFrom(draw(shapes()))
    elif brk == "method":
        req.speculative_method = draw(st.sampled_from(["lookahead", "OFF", "\x00", " ngram"]))
    return req
