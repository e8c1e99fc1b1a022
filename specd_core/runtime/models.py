"""Loading Hugging Face causal LMs from a directory, and a per-session KV cache.

Every model goes through the same path as a user's checkpoint:
AutoModelForCausalLM / AutoTokenizer .from_pretrained(DIR). No hub access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specd_core.rules.tree import TokenTree
from specd_core.runtime.kv_budget import KVPool, kv_row_bytes
from specd_core.runtime.tree_tensors import TreeLevel, compact_cache, tree_attention

if TYPE_CHECKING:
    from specd_core.runtime.lean import LeanModel

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# --dtype choices: a dtype, "auto" = the checkpoint's own (checkpoint_dtype), or
# "default": float32 on a CPU, which has no fast half-precision path, and the
# checkpoint's own on a GPU, where an 8B model in float32 would take 32 GB.
DTYPE_CHOICES = ["float32", "float16", "bfloat16", "auto", "default"]


def resolve_device(device: str) -> str:
    """'auto' -> cuda when a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def checkpoint_dtype(config) -> str:
    """The dtype a checkpoint was saved in (config `dtype`, formerly
    `torch_dtype`), as a --dtype name; float32 when the config does not say
    or names one the engines do not run."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in _DTYPES else "float32"


def resolve_dtype(model_dir: str, dtype: str, device: str) -> str:
    """A --dtype value as a dtype name on `device` (resolved): "auto" reads the
    checkpoint's config; "default" is float32 on a CPU, "auto" elsewhere."""
    if dtype == "default":
        dtype = "float32" if device == "cpu" else "auto"
    if dtype == "auto":
        return checkpoint_dtype(AutoConfig.from_pretrained(model_dir))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    return dtype


def torch_dtype(model_dir: str, dtype: str, device: str) -> torch.dtype:
    """resolve_dtype's answer as a torch dtype."""
    return _DTYPES[resolve_dtype(model_dir, dtype, device)]


def load_model(model_dir: str, device: str = "auto", dtype: str = "default"):
    """Load a causal LM for inference (eval mode, no grad bookkeeping).
    dtype: see resolve_dtype (the default: float32 on a CPU, the checkpoint's
    own on a GPU)."""
    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(model_dir, dtype, device))
    return model.to(device).eval()


def load_tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


def context_length(config) -> int:
    """Max positions a model can attend to (Llama/Qwen2: max_position_embeddings, GPT-2: n_positions)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    raise ValueError(f"cannot tell the context length of a {type(config).__name__}")


def architecture(config) -> str:
    """What a replica reports as its model: the config's architectures[0]
    (e.g. LlamaForCausalLM), else its model_type."""
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else str(getattr(config, "model_type", "") or "unknown")


def hf_kv_row_bytes(config, dtype: torch.dtype) -> int:
    """Bytes per token of a Hugging Face DynamicCache: layers x 2 x KV heads x
    head dim x the weights' element size (GPT-2 style configs map these names
    through their attribute_map)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_row_bytes(config.num_hidden_layers, kv_heads, head_dim, dtype)


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

    def reserve(self, rows: int, what: str = "a session") -> None: ...

    def release(self) -> None: ...


class ModelRunner(Protocol):
    """What the drafter core and the tree builders use of a runner: a Runner,
    or the EAGLE head's HeadRunner (which has no Hugging Face fallback)."""

    engine: str
    kv_pool: KVPool | None  # the replica's KV budget (set by its core)

    @property
    def lean(self) -> LeanModel | None: ...

    @property
    def kv_row_bytes(self) -> int: ...

    @property
    def kv_dtype(self) -> torch.dtype: ...

    def new_session(self) -> ModelSession: ...

    def forward_batch(self, items: list, last_only: bool = False) -> list[torch.Tensor]: ...


class Runner:
    """A loaded model and the way its sessions run: the lean forward
    (specd_core.runtime.lean) where the architecture is supported, else Hugging Face's."""

    def __init__(self, model, engine: str = "auto"):
        from specd_core.runtime import lean

        if engine not in ("auto", "lean", "hf"):
            raise ValueError(f"engine must be auto | lean | hf, got {engine!r}")
        if engine == "lean" and not lean.supports(model.config):
            reason = lean.unsupported_reason(model.config)
            raise ValueError(f"the lean engine does not support {model.config.model_type} with this config: {reason}")
        if engine == "hf" and getattr(model, "lean_only", False):
            # A checkpoint loaded for the lean engine alone (specd_core/runtime/lean_load.py) has no forward.
            raise ValueError("the hf engine needs a model loaded by load_model")
        self.model = model
        self.lean = lean.LeanModel(model) if engine != "hf" and lean.supports(model.config) else None
        self.engine = "lean" if self.lean else "hf"
        # The replica's KV budget, set by its core (specd_core/runtime/model_core.py);
        # None: sessions grow unaccounted (tests, tools).
        self.kv_pool: KVPool | None = None

    @property
    def kv_row_bytes(self) -> int:
        """Bytes per cached token of this engine's sessions (the KV budget's unit)."""
        if self.lean is not None:
            return self.lean.kv_row_bytes
        return hf_kv_row_bytes(self.model.config, self.model.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.lean.kv_dtype if self.lean is not None else self.model.dtype

    def new_session(self) -> ModelSession:
        if self.lean is not None:
            return self.lean.new_session(pool=self.kv_pool)
        return SessionCache(self.model, self.kv_pool)

    def forward_batch(self, items: list, last_only: bool | list[bool] = False, hidden: bool | tuple[int, ...] = False):
        """items: (session, token_ids, positions | None, mask | None); a mask is
        an additive tensor or a TokenTree whose rows [root, node0 ..] these are
        (positions None). One forward for all of them on the lean engine; one
        after another on Hugging Face's.
        hidden: return (logits, last-layer hidden states before the final norm)
        (lean engine only: EAGLE features); layer ids: the states entering
        those layers side by side (LeanModel.forward_embeds)."""
        if hidden and self.lean is None:
            raise ValueError("hidden states (EAGLE features) need the lean engine")
        if self.lean is not None:
            if not items:
                return ([], []) if hidden else []
            return self.lean.forward_batch(items, last_only, hidden)
        flags = last_only if isinstance(last_only, list) else [last_only] * len(items)
        return [c.forward(ids, last_only=lo, **dense_item(c, p, m)) for (c, ids, p, m), lo in zip(items, flags)]


def dense_item(cache, positions, mask) -> dict:
    """An item's positions and mask as tensors, what a Hugging Face forward
    takes (a TokenTree's from tree_attention, a TreeLevel's own)."""
    if isinstance(mask, TreeLevel):
        pos, dense = mask.dense(cache.length)
        return {"positions": pos, "mask": dense}
    if not isinstance(mask, TokenTree):
        return {"positions": positions, "mask": mask}
    mask4, pos2 = tree_attention(mask, cache.length)
    return {"positions": pos2[0], "mask": mask4[0, 0]}


class SessionCache:
    """One session's KV cache (Hugging Face DynamicCache), rolled back in place.

    `DynamicCache.crop(-n)` slices each layer's K/V to drop the last n positions:
    a view, no copy of the cache (transformers >= 5 wants the NEGATIVE count).
    """

    def __init__(self, model, pool: KVPool | None = None):
        self.model = model
        # Full layers even where the model has sliding windows: HF's sliding-window
        # layers drop the rows past the window, and then cannot roll back.
        self.cache = DynamicCache()
        # Blocks of the replica's KV pool held for this session: taken (by
        # `reserve`, before a forward) as the cache grows, given back on release.
        # The DynamicCache itself grows by exactly the rows forwarded.
        self.pool, self.blocks = pool, 0

    def reserve(self, rows: int, what: str = "a session") -> None:
        """Account `rows` cached rows in blocks of the pool (CapacityExceeded,
        nothing taken, when they are not free)."""
        if self.pool is not None:
            need = self.pool.blocks_for(rows) - self.blocks
            if need > 0:
                self.blocks += self.pool.take(need, need, what)

    def release(self) -> None:
        """Drop the cache and give its blocks back (the session is over)."""
        self.cache = DynamicCache()
        if self.pool is not None:
            self.pool.give(self.blocks)
        self.blocks = 0

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
        self.reserve(self.length + len(token_ids))
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
        if length > self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        # Layer by layer: a forward that failed part-way (out of memory) has
        # appended its rows to the first layers only.
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep rows start+keep[j] at start+j (keep ascending), drop the rest:
        copies only the kept rows, in place (specd_core.runtime.tree_tensors.compact_cache)."""
        compact_cache(self.cache, start, keep)
