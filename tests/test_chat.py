"""GenerateRequest.messages: a chat rendered with the target tokenizer's chat
template gives exactly what a user gets applying the template by hand.

"By hand" is `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`
(ids), which tokenises the rendered text without adding special tokens: the
template writes the BOS text itself. The chat tokenizer here (tests/tiny_models.py
build_chat_tokenizer) adds a BOS on plain tokenisation, so rendering and then
tokenising with the defaults would start with two BOS and fail these tests.
"""
import subprocess
import sys

import grpc
import pytest

from orchestrator.edge.chat import NO_TEMPLATE, chat_prompt_ids
from specd import cli
from specd.local_stack import ROOT, Stack
from specd_core.api.v1 import specdec_pb2 as pb
from specd_core.errors import InvalidRequest
from specd_core.runtime.models import load_tokenizer
from tests.tiny_models import build_chat_pair, build_tokenizer

SYSTEM = "You write short Python."
CHATS = {
    "system+user": [("system", SYSTEM), ("user", "def read_config(path):")],
    "multi-turn": [("system", SYSTEM), ("user", "def f(x):"), ("assistant", "    return x"), ("user", "and g?")],
}
MAX_NEW = 16


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    return build_chat_pair(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat_tok(chat_pair):
    return load_tokenizer(chat_pair[0])


@pytest.fixture(scope="module")
def chat_stack(chat_pair):
    stack = Stack(*chat_pair)
    yield stack
    stack.stop()


def by_hand(tok, turns) -> tuple[list[int], str]:
    """(ids, text) of the chat template applied by hand, generation prompt added."""
    messages = [{"role": r, "content": c} for r, c in turns]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return ids, text


def stream(stack, **fields) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], "", None
    for r in stack.stub.Generate(pb.GenerateRequest(**fields), timeout=120):
        ids += r.token_ids
        text += r.text
        last = r
    return ids, text, last


def chat(turns) -> list[dict]:
    return [{"role": r, "content": c} for r, c in turns]


@pytest.mark.unit
@pytest.mark.parametrize("name", CHATS)
def test_rendering_is_the_template_by_hand_with_one_bos(name, chat_tok):
    want, text = by_hand(chat_tok, CHATS[name])
    assert chat_prompt_ids(chat_tok, CHATS[name]) == want
    bos = chat_tok.bos_token_id
    assert text.startswith(chat_tok.bos_token) and want[0] == bos and want[1] != bos
    # The trap this guards: tokenising the rendered text with the tokenizer's
    # defaults adds a second BOS.
    assert chat_tok(text)["input_ids"] == [bos] + want


@pytest.mark.unit
def test_rendering_errors_are_invalid_requests(chat_tok, tmp_path):
    cases = [
        ([], "messages must not be empty"),
        ([("user", "hi"), ("", "hi")], "messages[1].role must not be empty"),
        ([("robot", "beep")], "chat template failed on these messages: TemplateError: Unknown role: robot"),
    ]
    for turns, needle in cases:
        with pytest.raises(InvalidRequest) as info:
            chat_prompt_ids(chat_tok, turns)
        assert needle in str(info.value)
    with pytest.raises(InvalidRequest, match=NO_TEMPLATE):
        chat_prompt_ids(build_tokenizer(tmp_path / "plain"), [("user", "hi")])


@pytest.mark.services
@pytest.mark.parametrize("name", CHATS)
def test_messages_equal_the_template_applied_by_hand(name, chat_stack, chat_tok):
    turns = CHATS[name]
    ids, text = by_hand(chat_tok, turns)
    # A fixed K: speculation runs (the adaptive default may turn it off).
    want = stream(chat_stack, prompt_token_ids={"ids": ids}, max_new_tokens=MAX_NEW, num_speculative_tokens=3)
    got = stream(chat_stack, messages=chat(turns), max_new_tokens=MAX_NEW, num_speculative_tokens=3)
    assert got[:2] == want[:2] and len(got[0]) >= 4  # (an EOS may end it before MAX_NEW)
    assert got[2].stats.prompt_tokens == len(ids)  # one BOS, not two
    assert got[2].stats.drafted_tokens > 0
    # The rendered text sent as `prompt` (tokenised without special tokens) is the same prompt.
    by_text = stream(chat_stack, prompt=text, max_new_tokens=MAX_NEW, num_speculative_tokens=3)
    assert by_text[:2] == want[:2] and by_text[2].stats.prompt_tokens == len(ids)


BAD_CHATS = [
    ("prompt and messages", dict(prompt="x", messages=chat([("user", "hi")])), "prompt or messages, not both"),
    ("ids and messages", dict(prompt_token_ids={"ids": [5]}, messages=chat([("user", "hi")])),
     "prompt_token_ids or messages, not both"),
    ("empty messages", dict(messages=[]), "an empty messages list counts as none"),
    ("empty role", dict(messages=chat([("system", SYSTEM), ("", "hi")])), "messages[1].role must not be empty"),
    ("unknown role", dict(messages=chat([("user", "hi"), ("robot", "beep")])),
     "the target tokenizer's chat template failed on these messages: TemplateError: Unknown role: robot"),
    ("chat over context", dict(messages=chat([("user", "x = 1\n" * 300)])), "context is 256"),
]


@pytest.mark.services
@pytest.mark.parametrize("name,fields,needle", BAD_CHATS, ids=[b[0] for b in BAD_CHATS])
def test_bad_chats_are_invalid_argument(name, fields, needle, chat_stack):
    with pytest.raises(grpc.RpcError) as info:
        stream(chat_stack, max_new_tokens=4, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    # ... and the service still serves a chat.
    ids, _, last = stream(chat_stack, messages=chat(CHATS["system+user"]), max_new_tokens=4)
    assert len(ids) == 4 and last.finish_reason == "length"


@pytest.mark.services
def test_specd_generate_chat_prints_the_by_hand_text(chat_stack, chat_tok):
    """The real command: its --system and prompt become the system and user messages."""
    turns = CHATS["system+user"]
    ids, _ = by_hand(chat_tok, turns)
    _, want, _ = stream(chat_stack, prompt_token_ids={"ids": ids}, max_new_tokens=MAX_NEW)
    assert want.strip()  # a text to compare, not an empty one
    out = subprocess.run(
        [sys.executable, "-m", "specd", "generate", "--chat", "--system", SYSTEM, turns[1][1],
         "--address", chat_stack.orchestrator.address, "--max-new-tokens", str(MAX_NEW)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want
    assert f"prompt_tokens={len(ids)} " in out.stderr


@pytest.mark.unit
def test_system_without_chat_is_refused(capsys):
    assert cli.main(["generate", "x", "--system", "be brief", "--address", "127.0.0.1:1"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err
