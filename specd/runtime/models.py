"""Loading Hugging Face causal LMs from a directory, and a per-session KV cache.

Every model goes through the same path as a user's checkpoint:
AutoModelForCausalLM / AutoTokenizer .from_pretrained(DIR). No hub access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specd.rules.tree import compact_cache

if TYPE_CHECKING:
    from .lean import LeanModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    """'auto' -> cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(model_dir: str, device: str = "auto", dtype: str = "float32"):
    """Load a causal LM for inference (eval mode, no grad bookkeeping)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype])
    # transformers types its `to` (functools.wraps on a method) as if unbound.
    return model.to(resolve_device(device)).eval()  # type: ignore[arg-type]


def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def context_length(config) -> int:
    """Max positions a model can attend to (Llama/Qwen2: max_position_embeddings, GPT-2: n_positions)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError(f"cannot tell the context length of a {type(config).__name__}")


def model_context_length(model_dir: str) -> int:
    return context_length(AutoConfig.from_pretrained(model_dir))


def vocab_size(model) -> int:
    """Rows of the output layer: ids at or past this are outside the vocabulary."""
    return int(model.get_output_embeddings().weight.shape[0])


class ModelSession(Protocol):
    """One session's KV cache as the cores and the tree builders use it:
    a LeanSession, a SessionCache, or the EAGLE head's HeadSession."""

    @property
    def length(self) -> int: ...

    def forward(
        self,
        token_ids: list[int],
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def compact(self, start: int, keep: list[int]) -> None: ...


class ModelRunner(Protocol):
    """What the drafter core and the tree builders use of a runner: a Runner,
    or the EAGLE head's HeadRunner (which has no Hugging Face fallback)."""

    engine: str

    @property
    def lean(self) -> LeanModel | None: ...

    def new_session(self) -> ModelSession: ...

    def forward_batch(self, items: list, last_only: bool = False) -> list[torch.Tensor]: ...


class Runner:
    """A loaded model and the way its sessions run: the lean forward
    (specd.runtime.lean) where the architecture is supported, else Hugging Face's."""

    def __init__(self, model, engine: str = "auto"):
        from . import lean

        if engine not in ("auto", "lean", "hf"):
            raise ValueError(f"engine must be auto | lean | hf, got {engine!r}")
        if engine == "lean" and not lean.supports(model.config):
            reason = lean.unsupported_reason(model.config)
            raise ValueError(f"the lean engine does not support {model.config.model_type} with this config: {reason}")
        self.model = model
        self.lean = lean.LeanModel(model) if engine != "hf" and lean.supports(model.config) else None
        self.engine = "lean" if self.lean else "hf"

    def new_session(self) -> ModelSession:
        return self.lean.new_session() if self.lean else SessionCache(self.model)

    def forward_batch(self, items: list, last_only: bool | list[bool] = False, hidden: bool = False):
        """items: (session, token_ids, positions | None, mask | None). One forward
        for all of them on the lean engine; one after another on Hugging Face's.
        hidden: return (logits, last-layer hidden states before the final norm)
        (lean engine only: EAGLE features)."""
        if hidden and self.lean is None:
            raise ValueError("hidden states (EAGLE features) need the lean engine")
        if self.lean is not None:
            if not items:
                return ([], []) if hidden else []
            return self.lean.forward_batch(items, last_only, hidden)
        flags = last_only if isinstance(last_only, list) else [last_only] * len(items)
        return [c.forward(ids, last_only=lo, positions=p, mask=m) for (c, ids, p, m), lo in zip(items, flags)]


class SessionCache:
    """One session's KV cache (Hugging Face DynamicCache), rolled back in place.

    `DynamicCache.crop(-n)` slices each layer's K/V to drop the last n positions:
    a view, no copy of the cache (transformers >= 5 wants the NEGATIVE count).
    """

    def __init__(self, model):
        self.model = model
        # Full layers even where the model has sliding windows: HF's sliding-window
        # layers drop the rows past the window, and then cannot roll back.
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        last_only: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append token_ids to the cache; return their logits, (n, V) or (1, V).

        positions (n,) and an additive float mask (n, past+n) are for token trees;
        by default positions follow the cache and attention is causal."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.model.device)
        extra = {}
        if mask is not None:
            assert positions is not None  # a tree's mask comes with its nodes' positions
            extra["attention_mask"] = mask.to(self.model.dtype)[None, None]  # (1, 1, n, past+n)
            extra["position_ids"] = positions[None]
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0, **extra)
        return out.logits[0].float()

    def rollback(self, length: int) -> None:
        """Drop cached positions at and after `length`."""
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        if extra:
            self.cache.crop(-extra)

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep rows start+keep[j] at start+j (keep ascending), drop the rest:
        copies only the kept rows, in place (specd.rules.tree.compact_cache)."""
        compact_cache(self.cache, start, keep)
