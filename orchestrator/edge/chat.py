"""Chat messages to prompt ids with the target tokenizer's chat template.

The ids are exactly what a user gets applying the template by hand:
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`. That
tokenises the rendered text without adding special tokens, since templates
write their own BOS; tokenising the text with the tokenizer's defaults would
give a second BOS on tokenizers that add one (tests/test_chat.py checks both).
Text in a message that spells a special token is encoded as that token, as
`apply_chat_template` does by default: a client can send the same ids as
`prompt` anyway, so the service guards nothing by escaping them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2

from specd_core.errors import InvalidRequest

NO_TEMPLATE = "the target tokenizer has no chat template; send prompt or prompt_token_ids"


def chat_prompt_ids(tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """messages: (role, content) pairs, in order. Raises InvalidRequest for
    what the caller can fix: no messages, an empty role, a template that
    refuses the conversation (its own message passed on)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(NO_TEMPLATE)
    if not messages:
        raise InvalidRequest("messages must not be empty")
    for i, (role, _) in enumerate(messages):
        if not role:
            raise InvalidRequest(f"messages[{i}].role must not be empty")
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        # Templates refuse what they cannot render with raise_exception (a
        # TemplateError: an unknown role, roles out of order); their expressions
        # raise the others on messages they do not expect. Either way the
        # messages decide it, so it is the caller's error, with the template's words.
        raise InvalidRequest(
            f"the target tokenizer's chat template failed on these messages: {type(exc).__name__}: {exc}"
        ) from exc
    return list(ids)
