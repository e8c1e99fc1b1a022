"""The pair rule: a drafter may draft for a target when their tokenizers agree
on every id both know and on the special tokens both set
(specd_core/rules/vocab.py) - not when their embedding tables have the same rows.
Pure cases on plain dicts, then real tokenizers saved to directories
(orchestrator/pair.py) and the orchestrator refusing a wrong pair."""
import asyncio
import json
import shutil

import pytest
from transformers import AutoTokenizer

from orchestrator.config import OrchestratorConfig
from orchestrator.core import Orchestrator
from orchestrator.pair import IncompatiblePair, check_pair
from specd_core.rules.vocab import Vocabulary, pair_problem
from tests.tiny_models import VOCAB, build_model, build_padded_pair, build_tokenizer

pytestmark = pytest.mark.unit

EOS = {"eos": (0, "<eos>")}


def test_same_tokens_are_compatible_whatever_the_sizes():
    t = Vocabulary({0: "<eos>", 1: "a", 2: "b", 3: "<tool>"}, EOS)
    d = Vocabulary({0: "<eos>", 1: "a", 2: "b"}, EOS)  # the target knows one more id
    assert pair_problem(t, t) is None
    assert pair_problem(t, d) is None
    assert pair_problem(d, t) is None


def test_differing_ids_are_named_with_both_tokens():
    t = Vocabulary({0: "<eos>", 1: "a", 2: "b", 3: "c"}, EOS)
    d = Vocabulary({0: "<eos>", 1: "a", 2: "x", 3: "y"}, EOS)
    problem = pair_problem(t, d)
    assert problem is not None
    assert "2 of the 4 ids" in problem and "id 2: 'b' vs 'x'" in problem and "id 3: 'c' vs 'y'" in problem


def test_a_hole_on_one_side_differs():
    t = Vocabulary({0: "<eos>", 1: "a", 2: "b"}, EOS)
    d = Vocabulary({0: "<eos>", 2: "b"}, EOS)
    assert "id 1: 'a' vs None" in (pair_problem(t, d) or "")


def test_special_tokens_must_agree_where_both_set():
    t = Vocabulary({0: "<eos>", 1: "<pad>", 2: "a"}, {"eos": (0, "<eos>"), "pad": (1, "<pad>")})
    assert pair_problem(t, Vocabulary(t.tokens, {"eos": (0, "<eos>")})) is None  # pad unset on one side
    problem = pair_problem(t, Vocabulary(t.tokens, {"eos": (1, "<pad>"), "pad": (1, "<pad>")}))
    assert problem == "the eos token differs: target's '<eos>' (id 0) vs drafter's '<pad>' (id 1)"


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Tokenizer directories: base; the same with an added token; the same
    with a different added token at that id; the same with another eos."""
    root = tmp_path_factory.mktemp("tokenizers")
    build_tokenizer(root / "base")
    out = {"base": root / "base"}
    for name, change in (
        ("tool", lambda t: t.add_tokens(["<tool>"], special_tokens=True)),
        ("other", lambda t: t.add_tokens(["<other>"], special_tokens=True)),
        ("eos", lambda t: setattr(t, "eos_token", t.convert_ids_to_tokens(5))),
    ):
        tok = AutoTokenizer.from_pretrained(root / "base")
        change(tok)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return {k: str(v) for k, v in out.items()}


def test_the_same_tokenizer_passes(tokenizer_dirs):
    check_pair(tokenizer_dirs["base"], tokenizer_dirs["base"])
    # An added token only the target has: ids the drafter does not know.
    check_pair(tokenizer_dirs["tool"], tokenizer_dirs["base"])
    check_pair(tokenizer_dirs["base"], None)  # no drafter, nothing to check


def test_an_added_token_that_differs_is_refused_by_name(tokenizer_dirs):
    with pytest.raises(IncompatiblePair) as e:
        check_pair(tokenizer_dirs["tool"], tokenizer_dirs["other"])
    assert f"id {VOCAB}: '<tool>' vs '<other>'" in str(e.value)
    assert tokenizer_dirs["other"] in str(e.value) and "share the target's tokenizer" in str(e.value)


def test_a_different_eos_is_refused(tokenizer_dirs):
    with pytest.raises(IncompatiblePair, match="the eos token differs: target's '<|endoftext|>' \\(id 0\\)"):
        check_pair(tokenizer_dirs["base"], tokenizer_dirs["eos"])


def test_a_drafter_without_tokenizer_is_refused_clearly(tokenizer_dirs, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(IncompatiblePair, match="cannot load its tokenizer"):
        check_pair(tokenizer_dirs["base"], str(tmp_path))


def test_an_eagle_head_is_not_checked(tokenizer_dirs, tmp_path):
    from specd_core.runtime.eagle_head import KIND, is_head_dir

    (tmp_path / "config.json").write_text(json.dumps({"kind": KIND}))  # no tokenizer
    assert is_head_dir(tmp_path)
    check_pair(tokenizer_dirs["base"], str(tmp_path))


def test_orchestrator_takes_a_padded_pair_and_refuses_other_tokens(tmp_path):
    """Different embedding rows over one tokenizer: accepted (this refusal used
    to be on vocab_size). A drafter whose tokenizer differs: refused, naming it."""
    target, drafter = build_padded_pair(tmp_path / "padded", "llama", 448, 400)
    orch = _orchestrator(OrchestratorConfig(target, drafter, verifier_addresses=["127.0.0.1:9"],
                                            drafter_addresses=["127.0.0.1:9"]))
    assert orch.model.vocab_size == 448  # prompts are checked against the target's rows
    other = tmp_path / "other"
    shutil.copytree(drafter, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<other>"], special_tokens=True)
    tok.save_pretrained(other)
    tool = tmp_path / "tool"
    build_model(tool, "llama", "drafter", 3, _with_added(tmp_path / "tool-tok", "<tool>"), rows=448)
    with pytest.raises(IncompatiblePair, match=f"id {VOCAB}: '<tool>' vs '<other>'"):
        _orchestrator(OrchestratorConfig(str(tool), str(other), verifier_addresses=["127.0.0.1:9"]))


def _orchestrator(config) -> Orchestrator:
    """An Orchestrator built as its server builds it: on a running event loop
    (its replica clients are grpc.aio channels)."""

    async def build():
        return Orchestrator(config)

    return asyncio.run(build())


def _with_added(path, token):
    build_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([token], special_tokens=True)
    return tok
