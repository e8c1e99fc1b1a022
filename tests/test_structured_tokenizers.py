"""Structured output over tokenizers llguidance cannot read by itself.

A character-level WordLevel tokenizer with a plain `Fuse` decoder (which
llguidance refuses: "can't determine decoder type") gets its tokens' bytes
from the vocabulary (specd_core/runtime/token_text.py): constrained greedy,
in process and through the real services, equals target-only constrained
greedy computed from the model and llguidance alone over the vocabulary's own
characters. A tokenizer that no per-token bytes describe (the same one with
transformers' clean-up of " ." on) is refused with FAILED_PRECONDITION naming
why, and served unconstrained. A sweep of malformed structured_output and
other bad requests through both orchestrators shows that none ends INTERNAL.
"""
import json
import logging

import grpc
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from specd.local_stack import Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import Unsupported
from specd_core.net.grpc_util import status_for
from specd_core.rules.structured import OutputConstraint
from specd_core.runtime.grammar import GrammarEngine, apply_masks, engine_of, try_engine
from specd_core.runtime.models import load_model, load_tokenizer
from specd_core.runtime.token_text import TokenizerUnsupported, token_bytes
from tests.test_greedy_exact import NEAR_TIE
from tests.test_structured_greedy import constrained_greedy, grammar_of
from tests.tiny_models import build_char_tokenizer, build_model, build_perturbed_drafter, build_tokenizer

MAX_NEW = 40
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "regex": {"regex": "(def|class) [a-z_]{1,12}\\((self)?\\):"},
    "ebnf": {"ebnf": 'root ::= "x = " [0-9]{1,4}'},
}
PROMPTS = ["def parse(self, text):\n    ", "x = {'a': 1, 'b'", "class Foo:\n"]


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    """(target, drafter) on the Fuse tokenizer, and the target on the same
    tokenizer with clean-up on."""
    root = tmp_path_factory.mktemp("char")
    tok = build_char_tokenizer(root / "tok")
    target = build_model(root / "target", "llama", "target", 1, tok, 15.0)
    drafter = build_perturbed_drafter(target, root / "drafter", noise=0.3)
    cleaned = build_model(root / "cleaned", "llama", "target", 1, build_char_tokenizer(root / "tok2", clean_up=True),
                          15.0)
    return target, drafter, cleaned


def reference_tokenizer(tok):
    """llguidance over the vocabulary's own characters (a WordLevel piece is
    the character it writes), built without specd's derivation."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    specials = set(tok.all_special_ids)

    class Chars:
        eos_token_id, bos_token_id = tok.eos_token_id, None
        tokens = [(b"\xff" if i in specials else b"") + piece.encode() for piece, i in vocab]
        special_token_ids = sorted(specials)

        def __call__(self, text):
            if not isinstance(text, str):
                raise TypeError
            return tok.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Chars()))


def assert_greedy_equal(got, want, gaps, where):
    diverged = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diverged is not None:
        assert gaps[diverged] < NEAR_TIE, f"{where}: diverged at {diverged}, gap {gaps[diverged]:.2e}"
    else:
        assert got == want, f"{where}: {got} want {want}"


# -------------------------------------------------------------- unit tier --

@pytest.mark.unit
def test_llguidance_cannot_read_the_fuse_decoder(char_models):
    """The failure this path exists for: llguidance's own reading refuses."""
    tok = load_tokenizer(char_models[0])
    with pytest.raises(ValueError, match="decoder type"):
        llguidance.hf.from_tokenizer(tok)
    tokens = token_bytes(tok)
    assert tokens[tok.eos_token_id] == b"\xff" + tok.eos_token.encode()
    assert all(tokens[i] == p.encode() for p, i in tok.get_vocab().items() if i not in tok.all_special_ids)


@pytest.mark.unit
@torch.inference_mode()
def test_constrained_greedy_in_process_equals_target_only(char_models):
    """specd's engine over the Fuse tokenizer (its masks, its forced tokens)
    decodes as target-only constrained greedy over the reference tokenizer."""
    target = char_models[0]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    engine, ref = GrammarEngine(tok, [tok.eos_token_id]), reference_tokenizer(tok)
    width, finished = model.config.vocab_size, 0
    for kind, field in CONSTRAINTS.items():
        c = OutputConstraint(kind, next(iter(field.values())))
        for n, text in enumerate(PROMPTS):
            prompt = tok(text)["input_ids"]
            want, gaps = constrained_greedy(model, ref, grammar_of(kind, c.text), prompt, tok.eos_token_id, MAX_NEW)
            ref_m = llguidance.LLMatcher(ref, grammar_of(kind, c.text))
            session, got = engine.constraint(c, width), []
            while len(got) < MAX_NEW and (not got or got[-1] != tok.eos_token_id):
                assert session.forced() == ref_m.compute_ff_tokens()
                logits = model(torch.tensor([prompt + got])).logits[0, -1:].float()
                t = int(apply_masks(logits, session.allowed()[None]).argmax())
                session.commit([t])
                ref_m.consume_token(t)
                got.append(t)
            assert_greedy_equal(got, want, gaps, f"{kind} prompt {n}")
            finished += want[-1] == tok.eos_token_id
            if want[-1] == tok.eos_token_id:  # the decoded text is a sentence of the constraint
                assert ref_m.is_accepting()
    assert finished > 0


def sentencepiece_style(out_dir):
    """A Llama-style tokenizer: BPE over '▁'-spaced pieces with byte fallback
    (<0xNN> tokens), decoded by Replace('▁', ' '), ByteFallback, Fuse."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", *"abcdefxyz{}:,\"", "▁a", "▁x", "ab", "é"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "a"), ("▁", "x"), ("a", "b")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_vocabulary_bytes_equal_llguidance_s_own_reading(tmp_path, kind):
    """Where llguidance reads a tokenizer itself, the bytes derived from the
    vocabulary agree with its own: byte-level pieces that end inside a UTF-8
    character, '▁' as a space, <0xNN> byte-fallback tokens and special tokens
    included."""
    tok = build_tokenizer(tmp_path / "t") if kind == "byte-level" else sentencepiece_style(tmp_path / "t")
    theirs, ours = llguidance.hf.from_tokenizer(tok), token_bytes(tok)
    assert len(ours) == len(tok)
    partial = 0
    for i, b in enumerate(ours):
        if i in tok.all_special_ids:
            assert b == b"\xff" + tok.convert_ids_to_tokens(i).encode()
        elif b != b"\xff":  # byte 0xff alone: llguidance's special marker, never in text
            assert b == theirs.decode_bytes([i]), (i, tok.convert_ids_to_tokens(i), b)
            partial += "\ufffd" in b.decode(errors="replace")
    assert partial > 0  # pieces that end inside a character were covered
    if kind == "sentencepiece":
        assert ours[tok.convert_tokens_to_ids("▁a")] == b" a"
        assert ours[tok.convert_tokens_to_ids("<0xC3>")] == b"\xc3"


@pytest.mark.unit
def test_a_tokenizer_no_bytes_describe_is_refused_once(char_models, caplog):
    """Clean-up turns " ." into ".": a token's text depends on the one before,
    so no per-token bytes exist. The engine is refused with why, logged once;
    each request gets FAILED_PRECONDITION with the same reason, never INTERNAL."""
    tok = load_tokenizer(char_models[2])
    with caplog.at_level(logging.WARNING, logger="specd_core.runtime.grammar"):
        built = try_engine(tok, [tok.eos_token_id])
    assert isinstance(built, TokenizerUnsupported) and isinstance(built, Unsupported)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "not the concatenation of its tokens' texts" in lines[0], lines
    for _ in range(2):
        with pytest.raises(TokenizerUnsupported) as err:
            engine_of(built)
        code, message = status_for(err.value)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and message == lines[0]
    with pytest.raises(TokenizerUnsupported, match="EOS"):
        GrammarEngine(tok, [])


# ---------------------------------------------------------- services tier --

@pytest.fixture(scope="module")
def char_stacks(char_models):
    target, drafter, cleaned = char_models
    stacks = {"fuse": Stack(target, drafter)}
    try:
        stacks["cleaned"] = Stack(cleaned, None, orchestrator_args=("--method", "ngram"))
        yield stacks
    finally:
        for s in stacks.values():
            s.stop()


METHODS = {
    "off": dict(speculative_method="off"),
    "chain3": dict(num_speculative_tokens=3),
    "chain3-no-forced": dict(num_speculative_tokens=3, forced_drafting=False),
    "static-tree": dict(tree={"branching": [2, 2, 1]}),
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=4),
}


@pytest.mark.services
@torch.inference_mode()
def test_constrained_greedy_through_the_services_is_exact(char_models, char_stacks):
    target = char_models[0]
    model, tok = load_model(target, "cpu"), load_tokenizer(target)
    ref, stack = reference_tokenizer(tok), char_stacks["fuse"]
    drafted = forced = 0
    for kind, field in CONSTRAINTS.items():
        for n, text in enumerate(PROMPTS):
            prompt = tok(text)["input_ids"]
            want, gaps = constrained_greedy(model, ref, grammar_of(kind, field[kind]), prompt, tok.eos_token_id,
                                            MAX_NEW)
            for name, fields in METHODS.items():
                got, last = stack.generate(prompt_token_ids={"ids": prompt}, max_new_tokens=MAX_NEW,
                                           structured_output=field, **fields)
                assert_greedy_equal(got, want, gaps, f"{kind} prompt {n} {name}")
                drafted += last.stats.drafted_tokens
                forced += last.stats.forced_tokens
    assert drafted > 0 and forced > 0


@pytest.mark.services
def test_an_unsupported_tokenizer_refuses_constraints_and_serves_the_rest(char_stacks):
    stack = char_stacks["cleaned"]
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(prompt="x = ", max_new_tokens=4, structured_output={"regex": "[0-9]+"})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "structured output is unavailable" in err.value.details()
    assert "not the concatenation" in err.value.details()
    ids, last = stack.generate(prompt="x = ", max_new_tokens=4)
    assert len(ids) == 4 and last.finish_reason == "length"
    said = [line for line in stack.orchestrator.lines if "structured output is unavailable" in line]
    assert len(said) == 1, said  # one line, at start


# A sweep of the error paths: malformed constraints, constraints with what
# they refuse, and other bad input. Each must be a clear client error.
BAD = [
    dict(structured_output={"regex": "a["}),
    dict(structured_output={"regex": "(" * 300}),
    dict(structured_output={"json_schema": "{not json"}),
    dict(structured_output={"json_schema": "[1, 2]"}),
    dict(structured_output={"json_schema": json.dumps({"type": "object", "not": {"required": ["a"]}})}),
    dict(structured_output={"json_schema": json.dumps({"type": "nonsense"})}),
    dict(structured_output={"json_schema": json.dumps({"$ref": "#/nowhere"})}),
    dict(structured_output={"ebnf": 'root ::= "a'}),
    dict(structured_output={"ebnf": "root ::= undefined_rule"}),
    dict(structured_output={"ebnf": ""}),
    dict(structured_output={"regex": "a"}, pipeline_drafting=True),
    dict(forced_drafting=True),
    dict(structured_output={"regex": "[0-9]+"}, max_new_tokens=0),
    dict(structured_output={"regex": "[0-9]+"}, temperature=-1.0),
    dict(structured_output={"regex": "[0-9]+"}, prompt_token_ids={"ids": [10**6]}),
    dict(structured_output={"regex": "[0-9]+"}, tree={"branching": [0]}),
    dict(structured_output={"json_object": True}, speculative_method="nonsense"),
    dict(prompt_token_ids={"ids": [-1]}),
    dict(prompt="", max_new_tokens=4),
]
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.mark.services
@pytest.mark.parametrize("which", ["fuse", "cleaned"])
def test_no_error_path_ends_internal(char_stacks, which):
    stack = char_stacks[which]
    for fields in BAD:
        request = {"prompt": "x = ", "max_new_tokens": 8, **fields}
        try:
            stack.generate(**request)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        assert code == grpc.StatusCode.OK or (code in CLIENT_ERRORS and details.strip()), (which, request, code,
                                                                                            details)
    ids, _ = stack.generate(prompt="x = ", max_new_tokens=4)
    assert len(ids) == 4  # still serving
    procs = [*stack.orchestrators, *stack.verifiers, *stack.drafters]
    logged = [line for p in procs for line in p.lines if "internal error" in line or "Traceback" in line]
    assert not logged, logged
