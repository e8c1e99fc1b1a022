"""A lean forward for Llama-family decoders (Llama, Qwen2 without sliding window)
with a preallocated KV cache.

Why: a small model's step is almost all framework overhead (a 2.6 M model costs
~3.4 ms per HF forward on 2 CPU cores, nearly all Python; docs/architecture.md,
"Why things are the way they are"), and the
HF DynamicCache grows by torch.cat every step. Here the weights are plain
tensors, the cache is one (layers, 2, kv_heads, capacity, head_dim) tensor
per session (grown in blocks: LeanSession) with a length, rollback is `length = n` (free), and tree
compaction copies only the kept rows. Models this does not support exactly
(other RoPE types, biases other than Qwen2's q/k/v bias, sliding windows) fall
back to the Hugging Face forward (specd.runtime.models.SessionCache); the test suite
checks logits against Hugging Face's forward.

The KV cache is float32 on a CPU even when the weights are bf16/fp16: CPU
attention kernels have no fast half-precision path (measured here: one
decode-step attention, 4 heads x 64 dims x 200 keys, takes 250 us in bf16 and
85 us in fp32), and with several sessions per forward attention runs once per
session and layer. The stored keys/values are the bf16 results widened, so
only the softmax's arithmetic is more precise than a bf16 cache's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .kv_budget import DEFAULT_BLOCK_ROWS, KVPool, kv_row_bytes

SUPPORTED = {"llama", "qwen2"}


def supports(config) -> bool:
    rope = getattr(config, "rope_parameters", None) or {}
    return (
        config.model_type in SUPPORTED
        and rope.get("rope_type", "default") == "default"
        and getattr(config, "hidden_act", "silu") == "silu"
        and not getattr(config, "mlp_bias", False)
        and (config.model_type == "qwen2" or not getattr(config, "attention_bias", False))
        and not getattr(config, "use_sliding_window", False)
    )


class _Plan(NamedTuple):
    """One item of a batched forward: where its rows go and how they attend."""

    session: LeanSession
    n: int  # rows it adds
    start: int  # its cache length before them
    end: int
    attn_mask: torch.Tensor | None  # additive, (1, 1, n, end); None: see causal
    causal: bool  # without a mask: causal over the new rows (no cached rows before)


class LeanModel:
    """Weights pulled out of a loaded HF model; forward on a LeanSession."""

    def __init__(self, hf_model):
        cfg = hf_model.config
        self.config = cfg
        self.device = hf_model.device
        self.dtype = next(hf_model.parameters()).dtype
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        base = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)
        m = hf_model.model
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            # One fused QKV matmul: fewer kernel launches is what matters at this size.
            qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
            self.layers.append(
                {
                    "ln1": layer.input_layernorm.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                    "qkv_w": qkv_w,
                    "qkv_b": qkv_b,
                    "o": a.o_proj.weight,
                    "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    "down": mlp.down_proj.weight,
                }
            )
        self.vocab_size = self.lm_head.shape[0]

    def new_session(self, max_len: int | None = None, pool: KVPool | None = None) -> LeanSession:
        return LeanSession(self, max_len or self.max_positions, pool)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one cache row over all layers (the KV budget's unit, specd/runtime/kv_budget.py)."""
        return kv_row_bytes(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype)

    @property
    def hf_config(self):
        return self.config

    def _rms(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def _rope(self, x, pos):  # x: (R, H, d), pos: (R,)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (R, 1, d)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        s: LeanSession,
        token_ids: list[int],
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Append tokens at cache rows [length, length+n); return logits (n or 1, V).

        positions: (n,) RoPE positions (default: the cache rows); mask: (n, length+n)
        additive float mask over the cache rows (default: causal)."""
        return self.forward_batch([(s, token_ids, positions, mask)], last_only)[0]

    @torch.inference_mode()
    def forward_batch(self, items: list, last_only: bool | list[bool] = False, hidden: bool = False):
        """One forward for several sessions: items are (session, token_ids,
        positions | None, mask | None) as in `forward`; returns each one's logits,
        or (logits, hidden states) with `hidden`. last_only: for all items, or
        one flag per item (a prefill beside verifies needs only its last row).

        Every weight matmul (QKV, output, MLP, LM head) runs once over the rows
        of all sessions together - at small batch a step is bound by reading
        the weights, so this is where batching pays. Attention runs per session
        on its own cache rows, in place: no session's cache is copied."""
        ids = [t for _, token_ids, _, _ in items for t in token_ids]
        return self.forward_embeds(items, self.embed[torch.tensor(ids, device=self.device)], last_only, hidden)

    @torch.inference_mode()
    def forward_embeds(self, items: list, x: torch.Tensor, last_only: bool | list[bool] = False, hidden: bool = False):
        """forward_batch from input rows x (R, C) instead of token embeddings
        (the token ids of items only count rows). hidden: also return each
        item's last-layer hidden states before the final norm, (n, C), every
        row even with last_only - the features an EAGLE head reads (and, for a
        head built on this class, the features it predicts)."""
        plans, pos = self._plan(items)
        sizes = [p.n for p in plans]
        rows = sum(sizes)
        for i, L in enumerate(self.layers):
            x = x + self._attention(i, L, x, plans, pos, rows)
            x = x + self._mlp(L, x)
        for p in plans:
            p.session.length = p.end
        states = list(x.split(sizes)) if hidden else None  # (n, C) per session
        logits = self._logits(x, sizes, last_only)
        return (logits, states) if hidden else logits

    def _plan(self, items: list) -> tuple[list[_Plan], torch.Tensor]:
        """Each item's cache rows (reserved now) and attention mask, and the
        RoPE positions of all rows, (R,)."""
        plans, positions_all = [], []
        for s, token_ids, positions, mask in items:
            n, start = len(token_ids), s.length
            end = start + n
            s.reserve(end)
            positions_all.append(positions if positions is not None else torch.arange(start, end, device=self.device))
            attn_mask, causal = self._attn_mask(mask, n, start, end)
            plans.append(_Plan(s, n, start, end, attn_mask, causal))
        pos = positions_all[0] if len(items) == 1 else torch.cat(positions_all)
        return plans, pos

    def _attn_mask(self, mask: torch.Tensor | None, n: int, start: int, end: int) -> tuple[torch.Tensor | None, bool]:
        """(additive mask (1, 1, n, end) or None, is_causal) for n new rows after start cached ones."""
        kvt = self.kv_dtype
        if mask is not None:
            return mask.to(kvt)[None, None], False
        if n > 1 and start > 0:
            # Causal over the new rows, full attention to the past.
            attn_mask = torch.full((n, end), float("-inf"), dtype=kvt, device=self.device)
            attn_mask[:, :start] = 0
            attn_mask[:, start:] = torch.triu(attn_mask[:, start:], diagonal=1)
            return attn_mask[None, None], False
        return None, n > 1

    def _attention(self, i: int, L: dict, x: torch.Tensor, plans: list[_Plan], pos: torch.Tensor, rows: int):
        """Layer i's attention block over all rows: its output projection, (R, C).
        Writes each session's new keys and values into its cache rows."""
        hd, nh, nkv, kvt = self.head_dim, self.n_heads, self.n_kv, self.kv_dtype
        h = self._rms(x, L["ln1"])
        qkv = F.linear(h, L["qkv_w"], L["qkv_b"])  # (R, (nh+2nkv)*hd)
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        # RoPE and the cast to the cache's dtype once over every session's rows.
        q = self._rope(q.view(rows, nh, hd), pos).to(kvt).transpose(0, 1)  # (nh, R, hd)
        k = self._rope(k.view(rows, nkv, hd), pos).to(kvt).transpose(0, 1)  # (nkv, R, hd)
        v = v.view(rows, nkv, hd).to(kvt).transpose(0, 1)
        ys, r0 = [], 0
        for s, n, start, end, attn_mask, causal in plans:
            s.kv[i, 0, :, start:end] = k[:, r0 : r0 + n]
            s.kv[i, 1, :, start:end] = v[:, r0 : r0 + n]
            # 4-D (batch of 1): with 3-D inputs PyTorch's CPU dispatch takes the
            # unfused "math" attention, ~3.5x slower per call here (334 vs 94 us
            # for 5 queries x 155 keys), and a batched verify makes a call per
            # session and layer.
            ys.append(
                F.scaled_dot_product_attention(
                    q[None, :, r0 : r0 + n],
                    s.kv[i, 0, None, :, :end],
                    s.kv[i, 1, None, :, :end],
                    attn_mask=attn_mask,
                    is_causal=causal,
                    enable_gqa=nh != nkv,
                )[0]
            )  # (nh, n, hd)
            r0 += n
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # (nh, R, hd)
        return F.linear(y.transpose(0, 1).reshape(rows, nh * hd).to(x.dtype), L["o"])

    def _mlp(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP block (SwiGLU), (R, C)."""
        h = self._rms(x, L["ln2"])
        gate, up = F.linear(h, L["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, L["down"])

    def _logits(self, x: torch.Tensor, sizes: list[int], last_only: bool | list[bool]) -> list[torch.Tensor]:
        """Final norm and LM head over the rows wanted: every row, or each
        item's last where last_only says so; one (n or 1, V) float tensor per item."""
        if last_only:
            flags = last_only if isinstance(last_only, list) else [True] * len(sizes)
            if all(flags):
                x = x[torch.tensor(sizes, device=self.device).cumsum(0) - 1]  # each session's last row
            else:
                ends = torch.tensor(sizes).cumsum(0).tolist()
                keep = [r for n, e, last in zip(sizes, ends, flags) for r in ((e - 1,) if last else range(e - n, e))]
                x = x[torch.tensor(keep, device=self.device)]
            sizes = [1 if last else n for n, last in zip(sizes, flags)]
        return list(F.linear(self._rms(x, self.norm), self.lm_head).float().split(sizes))


class LeanSession:
    """One session's KV rows; rollback is moving the length, compaction copies only kept rows.

    The cache is one contiguous tensor (attention reads it in place) whose
    capacity is a whole number of blocks of the replica's KV pool
    (specd/runtime/kv_budget.py); it grows geometrically in blocks, so copies
    stay amortised, never past what the pool grants nor the model's context,
    and gives its blocks back on `release` (the session closed or expired).
    Without a pool (tests, tools) it grows the same way, unaccounted."""

    GROWTH = 0.25  # a grow adds at least this fraction of the capacity (and at least one block)

    def __init__(self, model: LeanModel, max_len: int, pool: KVPool | None = None):
        self.lean = model
        self.max_len = max_len
        self.pool = pool
        self.block_rows = pool.block_rows if pool else DEFAULT_BLOCK_ROWS
        self.kv = self._alloc(0)  # the first reserve (the prefill) sizes it
        self.length = 0

    @property
    def capacity(self) -> int:
        """Rows the cache holds without growing."""
        return self.kv.shape[3]

    @property
    def blocks(self) -> int:
        """Blocks of the pool this session holds."""
        return self.capacity // self.block_rows

    @torch.inference_mode()
    def _alloc(self, rows: int) -> torch.Tensor:
        m = self.lean
        return torch.zeros(len(m.layers), 2, m.n_kv, rows, m.head_dim, dtype=m.kv_dtype, device=m.device)

    @torch.inference_mode()
    def reserve(self, rows: int, what: str = "a session") -> None:
        """Grow capacity to hold `rows` rows: by max(1 block, GROWTH of the
        capacity), or just the blocks needed when the pool has no more.
        CapacityExceeded when even those are not free; the session is unchanged
        then (nothing taken, nothing copied)."""
        if rows > self.max_len:
            raise ValueError(f"{rows} rows exceed the model's context of {self.max_len}")
        if rows <= self.capacity:
            return
        have, limit = self.blocks, -(-self.max_len // self.block_rows)
        need = -(-rows // self.block_rows) - have
        want = min(max(need, max(1, int(have * self.GROWTH))), limit - have)
        got = self.pool.take(want, need, what) if self.pool else want
        try:
            new = self._alloc((have + got) * self.block_rows)
        except BaseException:  # out of device memory: the blocks were not used
            if self.pool:
                self.pool.give(got)
            raise
        new[:, :, :, : self.length] = self.kv[:, :, :, : self.length]
        self.kv = new

    def release(self) -> None:
        """Free the cache and give its blocks back (the session is over)."""
        blocks = self.blocks
        self.kv, self.length = self._alloc(0), 0
        if self.pool:
            self.pool.give(blocks)

    def forward(self, token_ids: list[int], last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        return self.lean.forward(self, token_ids, positions, mask, last_only)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length}")
        self.length = length

    @torch.inference_mode()
    def compact(self, start: int, keep: list[int]) -> None:
        """Keep rows start+keep[j] at start+j (keep ascending), drop the rest."""
        if keep != list(range(len(keep))):  # a kept prefix is already in place
            idx = torch.tensor(keep, device=self.kv.device) + start
            self.kv[:, :, :, start : start + len(keep)] = self.kv[:, :, :, idx]
        self.rollback(start + len(keep))
