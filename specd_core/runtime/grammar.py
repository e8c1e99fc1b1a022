"""Structured output: a constraint on the generated text, as token masks.

The engine is llguidance (Microsoft's Rust grammar engine, also behind
vLLM's and SGLang's `guidance` backends). It was chosen over xgrammar because
its wheel has no dependencies (xgrammar pulls triton, transformers and torch
pins onto a CPU-only install), and because its matcher rolls back by whole
tokens and computes the tokens a grammar forces - both of which speculation
needs: draft tokens advance the matcher only tentatively, and forced tokens
are drafted for free.

`OutputConstraint` is what a request asks for; `GrammarEngine` (one per
tokenizer) compiles it, once per distinct constraint, and makes a
`Constraint` per session. A Constraint stands at the session's committed
tokens; `allowed(path)` answers for a position `path` draft tokens further
on, moving the matcher there and leaving it there (the next call rolls back
only what it does not share), so walking a chain or a tree depth-first costs
one token step per node. `commit` moves it to a new committed state.

The law a constrained request samples from: the logits with every token the
constraint forbids set to -inf, then temperature / top-k / top-p. Masking
first (as vLLM and SGLang do) means top-k and top-p choose among allowed
tokens; masking after them could leave no token at all.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specd_core.errors import InvalidRequest
from specd_core.rules.structured import OutputConstraint
from specd_core.runtime.token_text import TokenizerUnsupported, token_bytes

log = logging.getLogger(__name__)

# JSON output without free whitespace: one way to write each value, so that a
# key's `": "` or a closing `}` is forced (drafted for free) and a model cannot
# spend its tokens on indentation. A schema's own "x-guidance" options win.
JSON_DEFAULTS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(c: OutputConstraint) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
    import llguidance

    if c.kind in ("json_schema", "json_object"):
        if c.kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json.loads(c.text)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"structured_output.json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(
                    f"structured_output.json_schema must be a JSON object (a schema), got {type(schema).__name__}"
                )
        if schema is True:
            schema = {}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise InvalidRequest(f"structured_output.json_schema: {exc}") from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.text)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(c.text)  # GBNF (`root ::= ...`) or Lark as it is
    except Exception as exc:  # the converter raises its own parse errors
        raise InvalidRequest(f"structured_output.ebnf: {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def compile_constraint(c: OutputConstraint, tokenizer=None) -> str:
    """The checked llguidance grammar of a constraint; InvalidRequest naming
    what is wrong (a syntax error, an unsupported schema keyword)."""
    import llguidance

    grammar = _grammar(c.validate())
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        raise InvalidRequest(f"structured_output.{c.kind}: {'; '.join(m.strip() for m in messages)}")
    # Warnings name schema keywords the engine would ignore (e.g. `not`): a
    # constraint half applied is not the one asked for.
    ignored = [m.strip() for m in messages if "nimplemented" in m or "nsupported" in m]
    if ignored:
        raise InvalidRequest(f"structured_output.{c.kind} uses what is not supported: {'; '.join(ignored)}")
    return grammar


def eos_ids(model_config, tokenizer) -> list[int]:
    """The ids that end generation: the model's own (a list for e.g. Llama 3),
    else the tokenizer's."""
    ids = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted({int(i) for i in ids})


class _VocabEncoder:
    """What llguidance.TokenizerWrapper wraps: the vocabulary's bytes and the
    tokenizer's own encoding (the engine tokenizes the text a grammar forces)."""

    def __init__(self, tokenizer, tokens: list[bytes], eos: list[int]):
        self._tokenizer, self.tokens = tokenizer, tokens
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self.special_token_ids: list[int] = []  # marked in `tokens` already

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")  # the wrapper then passes str
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def grammar_tokenizer(tokenizer, eos: list[int]):
    """The llguidance tokenizer for a Hugging Face one: llguidance's own reading
    where it can read the decoder, else one built from each id's bytes
    (specd_core/runtime/token_text.py); TokenizerUnsupported, naming why,
    where neither can."""
    import llguidance
    import llguidance.hf

    if not eos:
        raise TokenizerUnsupported("structured output is unavailable: neither the model nor its tokenizer names EOS")
    try:
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=eos if len(eos) != 1 else eos[0])
    except ValueError:
        pass  # a decoder llguidance does not read (or a slow tokenizer): read the vocabulary
    wrapper = llguidance.TokenizerWrapper(_VocabEncoder(tokenizer, token_bytes(tokenizer), eos))
    try:
        return llguidance.LLTokenizer(wrapper, eos_token=eos if len(eos) != 1 else eos[0])
    except ValueError as exc:
        raise TokenizerUnsupported(
            f"structured output is unavailable: the grammar engine refused the tokenizer: {exc}"
        ) from None


# Every Constraint alive in this process: a matcher lives as long as its
# session, and this count (a Prometheus gauge per service) shows one that
# outlived it.
_LIVE: weakref.WeakSet[Constraint] = weakref.WeakSet()


def live_matchers() -> int:
    return len(_LIVE)


class GrammarEngine:
    """Compiles constraints for one tokenizer, each distinct one once (an LRU
    of `cache_size`), and makes the sessions' matchers. Thread-safe.
    TokenizerUnsupported when structured output cannot run over `tokenizer`."""

    def __init__(self, tokenizer, eos: list[int], cache_size: int = 256):
        self._tokenizer = grammar_tokenizer(tokenizer, eos)
        self.eos = list(eos)
        self._cache: OrderedDict[OutputConstraint, str] = OrderedDict()
        self._size, self._lock = cache_size, threading.Lock()
        self.compiles = 0  # constraints compiled (cache misses)

    def compile(self, c: OutputConstraint) -> str:
        with self._lock:
            if c in self._cache:
                self._cache.move_to_end(c)
                return self._cache[c]
        grammar = compile_constraint(c, self._tokenizer)
        with self._lock:
            self.compiles += 1
            self._cache[c] = grammar
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return grammar

    def constraint(self, c: OutputConstraint, width: int, committed: Sequence[int] = ()) -> Constraint:
        """A session's constraint of logits `width` wide, standing after the
        generated tokens `committed` (a rebuilt session's)."""
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer, self.compile(c), log_level=0)
        if m.is_error():
            raise InvalidRequest(f"structured_output.{c.kind}: {m.get_error()}")
        out = Constraint(m, width)
        if committed:
            out.commit(list(committed), "the generated tokens of a rebuilt session")
        return out


def try_engine(tokenizer, eos: list[int]) -> GrammarEngine | TokenizerUnsupported:
    """The engine over `tokenizer`, or why structured output cannot run over
    it (logged here, once: the caller keeps the reason and answers each
    constrained request with it, FAILED_PRECONDITION)."""
    try:
        return GrammarEngine(tokenizer, eos)
    except TokenizerUnsupported as exc:
        log.warning("%s", exc)
        return exc


def engine_of(built: GrammarEngine | TokenizerUnsupported) -> GrammarEngine:
    """try_engine's engine; its reason raised (a fresh exception each time)."""
    if isinstance(built, TokenizerUnsupported):
        raise TokenizerUnsupported(str(built))
    return built


class Constraint:
    """A session's matcher: committed state plus a tentative path (see module)."""

    def __init__(self, matcher, width: int):
        self._m, self.width = matcher, width
        self._path: list[int] = []  # tentative tokens past the committed state
        _LIVE.add(self)

    def _goto(self, path: list[int]) -> bool:
        """Stand `path` tokens past the committed state; False (standing at the
        longest allowed prefix) when the constraint forbids one of them."""
        same = 0
        for a, b in zip(self._path, path):
            if a != b:
                break
            same += 1
        if len(self._path) > same:
            self._m.rollback(len(self._path) - same)
            del self._path[same:]
        rest = list(path[same:])
        if not rest:
            return True
        # try_consume stops before a forbidden token (a plain consume would put
        # the matcher in an error state it never leaves).
        n = self._m.try_consume_tokens(rest)
        self._path += rest[:n]
        return n == len(rest)

    def allowed(self, path: Sequence[int] = ()) -> torch.Tensor | None:
        """(width,) bool: the tokens allowed after `path`; None when the
        constraint forbids a token of the path itself."""
        if not self._goto(list(path)):
            return None
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").astype(bool)
        out = torch.zeros(self.width, dtype=torch.bool)
        n = min(self.width, mask.shape[0])
        out[:n] = torch.from_numpy(mask[:n])
        if not out.any():
            # Only past the end (after EOS), which nothing keeps: leave the
            # row unconstrained rather than give a softmax no token at all.
            out[:] = True
        return out

    def forced(self, path: Sequence[int] = ()) -> list[int]:
        """The tokens the constraint forces after `path` (llguidance's
        fast-forward tokens), possibly none."""
        if not self._goto(list(path)):
            return []
        return [t for t in self._m.compute_ff_tokens() if t < self.width]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the committed state, the constraint allows."""
        self._goto([])
        return self._m.validate_tokens(list(tokens))

    def commit(self, tokens: Sequence[int], what: str = "committed tokens") -> None:
        """Move to a new committed state. Tokens past the constraint's end (a
        verify's bonus after EOS, which the output drops) are ignored."""
        self._goto([])
        if tokens and self._m.try_consume_tokens(list(tokens)) != len(tokens) and not self._m.is_stopped():
            # Committed tokens were all sampled under this constraint's masks.
            raise InvalidRequest(f"{what} break the output constraint: {self._m.get_error() or list(tokens)}")

    def tree_masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """(N+1, width) bool: row 0 the tokens allowed after the committed
        state (the root's children), row i+1 those allowed after node i's path.
        A node the constraint forbids can never be kept, so rows below it
        allow everything: they are never read."""
        paths: list[list[int] | None] = []
        rows = [self.allowed([])]
        for t, p in zip(tokens, parents):
            base = [] if p < 0 else paths[p]
            path = None if base is None else base + [t]
            paths.append(path)
            rows.append(None if path is None else self.allowed(path))
        full = torch.ones(self.width, dtype=torch.bool)
        return torch.stack([r if r is not None else full for r in rows])


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Logits (R, V) with what masks (R, W) forbid at -inf; ids past W (a
    padded table) are forbidden too."""
    out = logits.clone()
    w = min(masks.shape[-1], out.shape[-1])
    out[..., :w] = out[..., :w].masked_fill(~masks[..., :w].to(out.device), float("-inf"))
    if out.shape[-1] > w:
        out[..., w:] = float("-inf")
    return out
