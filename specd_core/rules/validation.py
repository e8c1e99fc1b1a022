"""Input checks shared by the services; each raises InvalidRequest with a message
that says what is wrong."""

from __future__ import annotations

from specd_core.errors import InvalidRequest


def check_token_ids(ids, vocab_size: int, max_len: int | None, what: str, allow_empty: bool = False) -> None:
    if not ids and not allow_empty:
        raise InvalidRequest(f"{what} must not be empty")
    if max_len is not None and len(ids) >= max_len:
        raise InvalidRequest(
            f"{what} has {len(ids)} tokens; the model's context is {max_len} "
            f"(at least one position must stay free to generate)"
        )
    bad = [t for t in ids if not (0 <= t < vocab_size)]
    if bad:
        raise InvalidRequest(f"{what} holds {len(bad)} id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
