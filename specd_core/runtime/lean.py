"""A lean forward for decoder-only transformers over a paged KV cache:
Llama 1-3.3, Mistral, Qwen2/2.5, Qwen3, Phi-3/3.5, Gemma-2 and Gemma-3 text
(specd_core/runtime/arch.py says which configs exactly; docs/models.md lists them).

Why: a small model's step is almost all framework overhead (a 2.6 M model costs
~3.4 ms per HF forward on 2 CPU cores, nearly all Python; docs/architecture.md,
"Why things are the way they are"), and the HF DynamicCache grows by
torch.cat every step. Here the weights are plain tensors and a step costs
the same number of operators whatever the number of sessions in it:

* the cache is paged (specd_core/runtime/paged_kv.py): one tensor of blocks
  per replica, sized by its KV budget; a session is a table of block ids and
  a length, so growing takes blocks and copies nothing, rollback is
  `length = n`, and tree compaction moves only the kept rows;
* one step (specd_core/runtime/lean_step.py) plans every session's rows at
  once: their cache slots, RoPE positions and attention masks, uploaded as
  one tensor and built on the device once per window size, not per layer;
* per layer, every weight matmul runs once over all rows, all new keys and
  values go to their blocks in one indexed write, and attention is one call
  over a padded batch (each session's keys gathered from its blocks by one
  index; sessions of very different sizes in a few padded groups);
* on CUDA, steps of a known shape (decode, verify, draft levels) replay a
  CUDA graph of every layer instead of launching its kernels one by one
  (specd_core/runtime/step_graphs.py).

Configs this does not cover exactly (`supports`; e.g. MoE, other
architectures, unknown RoPE types) fall back to the Hugging Face forward
(specd_core.runtime.models.SessionCache); tests/test_families.py checks every
covered family's logits, trees, compaction, hidden states and batching against
Hugging Face's forward, tests/test_paged_kv.py the paging and the padding.

What differs between the families is data (`arch.Arch`): Gemma's (1 + weight)
norms, sandwich norms, scaled embeddings, soft-capping and query_pre_attn_scalar;
Qwen3/Gemma-3's per-head q/k norms; Phi-3's fused weights and partial rotary;
sliding windows per layer; RoPE per layer type (specd_core/runtime/rope.py, HF's own
frequency functions).

The KV cache is float32 on a CPU even when the weights are bf16/fp16: CPU
attention kernels have no fast half-precision path (measured here: one
decode-step attention, 4 heads x 64 dims x 200 keys, takes 250 us in bf16 and
85 us in fp32). The stored keys/values are the bf16 results widened, so
only the softmax's arithmetic is more precise than a bf16 cache's.

On a CPU, gathering the keys costs a copy of every session's rows per layer,
which the old in-place attention per session did not pay: for short contexts
the saved operators win, for long ones (8 sessions x 900 tokens of the demo
target) the copy costs more (benchmarks/README.md, the engine section).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specd_core.runtime import attention_backends, step_graphs
from specd_core.runtime.arch import Arch, describe
from specd_core.runtime.dense import Dense
from specd_core.runtime.kv_budget import DEFAULT_BLOCK_ROWS, KVPool, kv_row_bytes
from specd_core.runtime.lean_attention import capped_attention
from specd_core.runtime.lean_step import Group, Step, plan
from specd_core.runtime.paged_kv import LeanSession
from specd_core.runtime.rope import Rope

__all__ = ["LeanModel", "LeanSession", "supports", "unsupported_reason"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def supports(config) -> bool:
    """Whether the lean forward computes exactly what Hugging Face's does for this config."""
    return isinstance(describe(config), Arch)


def unsupported_reason(config) -> str | None:
    """Why the lean forward does not cover a config (None: it does)."""
    arch = describe(config)
    return None if isinstance(arch, Arch) else arch


def _fused(module, fused: str, parts: tuple[str, ...]) -> Dense:
    """A module's projections concatenated along the output rows, as one Dense."""
    if hasattr(module, fused):
        return _dense(getattr(module, fused))
    linears = [getattr(module, p) for p in parts]
    bias = torch.cat([x.bias for x in linears]) if linears[0].bias is not None else None
    dense = Dense(torch.cat([x.weight for x in linears]), bias)
    rows = 0
    for x in linears:
        n = x.weight.shape[0]
        _point_at(x, dense.weight[rows : rows + n])
        rows += n
    return dense


def _dense(linear) -> Dense:
    dense = Dense(linear.weight, linear.bias)
    _point_at(linear, dense.weight)
    return dense


def _output_layer(hf_model) -> tuple[Dense, torch.Tensor]:
    """The output layer and the embeddings. Tied, one tensor serves both
    (looked up through the view where the head is stored transposed)."""
    embed = hf_model.model.embed_tokens
    tied = hf_model.lm_head.weight is embed.weight
    head = _dense(hf_model.lm_head)
    if tied:
        _point_at(embed, head.weight)
        return head, head.weight
    return head, embed.weight


def _point_at(holder, weight: torch.Tensor) -> None:
    """The checkpoint's holder of a weight (lean_load's plain objects, kept
    by the Runner) points at the same values in the lean engine's storage,
    so that a fused or transposed weight is not held twice. An nn.Module's
    parameters are left as they are: its owner may still train or save it."""
    if not isinstance(holder, torch.nn.Module):
        holder.weight = weight


def _rope(x, cos, sin):  # x: (R, H, d); cos, sin: (R, 1, rotary_dim)
    rd = cos.shape[-1]
    if rd != x.shape[-1]:  # partial rotary (Phi-3): the rest of each head passes through
        return torch.cat([_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = rd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: a cast where it is needed, else t itself without an
    operator call (on a GPU each call from Python costs host time, and three
    of a bf16 layer's seven casts are to the dtype the tensor already has)."""
    return t if t.dtype == dtype else t.to(dtype)


def _side_by_side(tapped: dict[int, torch.Tensor], taps: tuple[int, ...], sizes: list[int]) -> list[torch.Tensor]:
    """The states of `taps` side by side, split per session: (n, len(taps) * C) each."""
    wide = tapped[taps[0]] if len(taps) == 1 else torch.cat([tapped[t] for t in taps], -1)
    return list(wide.split(sizes))


def _layer_weights(model: LeanModel, i: int, layer) -> dict:
    """Layer i's weights as plain tensors, and which window and RoPE it uses."""
    a, mlp, arch = layer.self_attn, layer.mlp, model.arch
    # One fused QKV matmul: fewer kernel launches is what matters at this size.
    # Phi-3 stores QKV and gate/up fused already.
    qkv = _fused(a, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
    gate_up = _fused(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
    # The norm before the MLP: Gemma's pre_feedforward, the others' post_attention.
    ln2 = layer.pre_feedforward_layernorm if arch.sandwich else layer.post_attention_layernorm
    return {
        "ln1": model._norm_weight(layer.input_layernorm),
        "ln2": model._norm_weight(ln2),
        "post_attn": model._norm_weight(layer.post_attention_layernorm) if arch.sandwich else None,
        "post_ff": model._norm_weight(layer.post_feedforward_layernorm) if arch.sandwich else None,
        "q_norm": model._norm_weight(a.q_norm) if hasattr(a, "q_norm") else None,
        "k_norm": model._norm_weight(a.k_norm) if hasattr(a, "k_norm") else None,
        "qkv": qkv,
        "o": _dense(a.o_proj),
        "gate_up": gate_up,
        "down": _dense(mlp.down_proj),
        "kind": model.windows.index(arch.windows[i]),
        "rope": model._rope_keys.index(arch.rope_keys[i]),
    }


class LeanModel:
    """Weights pulled out of a loaded HF model; forward on a LeanSession."""

    graphable = True  # whether its steps may run through CUDA graphs (step_graphs.py)

    def __init__(self, hf_model):
        cfg = hf_model.config
        arch = describe(cfg)
        if not isinstance(arch, Arch):
            raise ValueError(f"the lean engine does not cover this {cfg.model_type} config: {arch}")
        self.arch = arch
        self.config = cfg
        self.device = hf_model.device
        self.dtype = next(hf_model.parameters()).dtype
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self.scale = arch.attn_scale
        # The SDPA implementations this engine's calls may use (None: torch's
        # choice) and its key bucket (0: exact shapes): attention_backends.py.
        self.attention_backends = attention_backends.from_env()
        self.key_bucket = attention_backends.key_bucket_from_env()
        self.fold_mode = attention_backends.fold_from_env()  # lean_step.fold_heads
        attention_backends.check_runs(
            self.attention_backends, self.device, self.kv_dtype, self.n_heads, self.n_kv, self.head_dim
        )
        self.softcap = arch.attn_softcap
        self.final_softcap = arch.final_softcap
        self._gemma_norm = arch.gemma_norm
        self._act = _ACTIVATIONS[arch.act]
        m = hf_model.model
        # Distinct windows and RoPE parameter sets; each layer points at its own.
        self.windows = list(dict.fromkeys(arch.windows))
        self._rope_keys = list(dict.fromkeys(arch.rope_keys))
        rotary_cls = type(m.rotary_emb)
        self.ropes = [Rope(cfg, rotary_cls, key, self.device, self.dtype) for key in self._rope_keys]
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as HF does.
        self.embed_scale = (
            torch.tensor(arch.embed_scale).to(self.device, self.dtype) if arch.embed_scale is not None else None
        )
        self.norm = self._norm_weight(m.norm)
        self.head, self.embed = _output_layer(hf_model)
        self.lm_head = self.head.weight
        self.layers = [_layer_weights(self, i, layer) for i, layer in enumerate(m.layers)]
        self.vocab_size = self.lm_head.shape[0]
        # Sessions made without a pool (tests, tools) share this one, which grows.
        self.default_pool = KVPool(0, DEFAULT_BLOCK_ROWS, self.kv_row_bytes, "lean", growable=True)
        # CUDA graphs of its bucketed steps (SPECD_CUDA_GRAPHS; None: off).
        self.graphs = step_graphs.for_model(self, step_graphs.mode_from_env())

    def _norm_weight(self, norm) -> torch.Tensor | None:
        # Gemma's RMSNorm multiplies by (1 + weight) in float32: precomputed once.
        # None: no norm there (a published EAGLE-1/2 head's, drafter_svc/eagle_published.py).
        if norm is None:
            return None
        return 1.0 + norm.weight.float() if self._gemma_norm else norm.weight

    def new_session(self, max_len: int | None = None, pool: KVPool | None = None) -> LeanSession:
        return LeanSession(self, max_len or self.max_positions, pool)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one cache row over all layers (the KV budget's unit, specd_core/runtime/kv_budget.py)."""
        return kv_row_bytes(len(self.layers), self.n_kv, self.head_dim, self.kv_dtype)

    def _rms(self, x, w):
        if w is None:  # a norm the model does not have
            return x
        # In float32 as Hugging Face's norms; torch's rms_norm is one call
        # from Python (its operators the same as the written-out formula's on
        # a CPU; a fused kernel where torch has one).
        shape, x32 = (x.shape[-1],), _cast(x, torch.float32)
        if self._gemma_norm:
            return _cast(F.rms_norm(x32, shape, w, self.eps), x.dtype)
        return _cast(F.rms_norm(x32, shape, eps=self.eps), x.dtype) * w

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
        additive float mask over the cache rows (default: causal), or a
        TokenTree whose rows [root, node0 ..] these are (its mask and
        positions are built in the step, specd_core/runtime/lean_step.py)."""
        return self.forward_batch([(s, token_ids, positions, mask)], last_only)[0]

    @torch.inference_mode()
    def forward_batch(self, items: list, last_only: bool | list[bool] = False, hidden: bool | tuple[int, ...] = False):
        """One forward for several sessions: items are (session, token_ids,
        positions | None, mask | None) as in `forward`; returns each one's logits,
        or (logits, hidden states) with `hidden`. last_only: for all items, or
        one flag per item (a prefill beside verifies needs only its last row).
        The sessions must share one KV pool.

        Every operator runs once over the rows of all sessions together (the
        module docstring): at small batch a step is bound by reading the
        weights and by launching operators, so this is where batching pays."""
        ids = [t for _, token_ids, _, _ in items for t in token_ids]
        x = self.embed[torch.tensor(ids, device=self.device)]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return self.forward_embeds(items, x, last_only, hidden)

    @torch.inference_mode()
    def forward_embeds(
        self, items: list, x: torch.Tensor, last_only: bool | list[bool] = False, hidden: bool | tuple[int, ...] = False
    ):
        """forward_batch from input rows x (R, C) instead of token embeddings
        (the token ids of items only count rows). hidden: also return each
        item's last-layer hidden states before the final norm, (n, C), every
        row even with last_only - the features an EAGLE head reads (and, for a
        head built on this class, the features it predicts). hidden as layer
        ids: the states entering those layers, id len(layers) the last
        layer's output before the final norm, side by side in that order,
        (n, len(ids) * C) (EAGLE-3's auxiliary layers)."""
        graphs = self.graphs if self.graphs is not None and self.graphs.takes(items) else None
        step = plan(
            self, items, last_only, step_graphs.key_columns if graphs is not None else None, fold=graphs is None
        )
        top = max(e.end for e in step.entries)
        spans = [(e.start, e.end, e.positions is None and e.tree is None) for e in step.entries]
        rope = []
        for r in self.ropes:
            cos, sin = r.cos_sin(step.positions, spans, top)
            rope.append((cos[:, None], sin[:, None]))
        taps = (len(self.layers),) if hidden is True else tuple(hidden or ())
        ran = graphs.run(step, x, rope, taps) if graphs is not None else None
        x, tapped = ran if ran is not None else self.run_layers(x, step, rope, taps)
        for e in step.entries:
            e.session.length = e.end
        sizes = [e.n for e in step.entries]
        states = _side_by_side(tapped, taps, sizes) if taps else None
        logits = self._logits(x, sizes, last_only, step.keep)
        return (logits, states) if taps else logits

    def run_layers(
        self, x: torch.Tensor, step: Step, rope: list, taps: tuple[int, ...], backends: list | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every layer over a planned step: the last layer's output (R, C)
        before the final norm, and the states entering the layers `taps`
        (id len(layers): that output). What a CUDA graph captures
        (specd_core/runtime/step_graphs.py): tensors in, tensors out.
        backends: the attention implementations (None: the model's setting)."""
        tapped: dict[int, torch.Tensor] = {}
        with attention_backends.restricted(backends or self.attention_backends):
            for i, L in enumerate(self.layers):
                if i in taps:
                    tapped[i] = x
                x = x + self._attention(i, L, x, step, rope[L["rope"]])
                x = x + self._mlp(L, x)
        tapped[len(self.layers)] = x
        return x, tapped

    def _attention(self, i: int, L: dict, x: torch.Tensor, step: Step, rope) -> torch.Tensor:
        """Layer i's attention block over all rows: its output projection, (R, C).
        Writes every session's new keys and values into its blocks first."""
        hd, nh, nkv, kvt = self.head_dim, self.n_heads, self.n_kv, self.kv_dtype
        rows = x.shape[0]
        h = self._attn_input(L, x)
        qkv = L["qkv"](h)  # (R, (nh+2nkv)*hd)
        cos, sin = rope
        if L["q_norm"] is None:
            # RoPE once over the query and key heads, which lie side by side
            # in qkv: half the operators of two calls, the same values.
            qk = _rope(qkv[:, : (nh + nkv) * hd].view(rows, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
        else:  # per-head norms before RoPE (Qwen3, Gemma-3), each with its own weights
            q, k = qkv[:, : nh * hd].view(rows, nh, hd), qkv[:, nh * hd : (nh + nkv) * hd].view(rows, nkv, hd)
            q, k = _rope(self._rms(q, L["q_norm"]), cos, sin), _rope(self._rms(k, L["k_norm"]), cos, sin)
        v = qkv[:, (nh + nkv) * hd :]
        # The cast to the cache's dtype once over every session's rows.
        q = _cast(q, kvt)  # (R, nh, hd)
        # Every session's new rows, K and V side by side, in one indexed write.
        new = _cast(torch.stack((k, v.view(rows, nkv, hd)), 1), kvt)  # (R, 2, nkv, hd)
        data = step.data[i].view(step.data.shape[1], -1)  # (storage rows, 2 * nkv * hd)
        data.index_copy_(0, step.write, new.view(rows, -1))
        ys = [self._attend(data, q, g, L["kind"]) for g in step.groups]
        y = ys[0] if len(ys) == 1 else torch.cat(ys)  # (padded rows, nh * hd)
        if step.order is not None:
            y = y[step.order]
        out = L["o"](_cast(y, x.dtype))
        return out if L["post_attn"] is None else self._rms(out, L["post_attn"])

    def _attn_input(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        """What q/k/v read (an EAGLE-3 head's reads more: drafter_svc/head_input.py)."""
        return self._rms(x, L["ln1"])

    def _attend(self, data: torch.Tensor, q: torch.Tensor, g: Group, kind: int) -> torch.Tensor:
        """One group's attention in one call: its keys gathered from the
        blocks by one index, (size * rows, nh * hd)."""
        hd, nh = self.head_dim, self.n_heads
        keys = g.keys[kind]
        if isinstance(keys, range):  # one session's rows, contiguous: read in place
            kv = data[keys.start : keys.stop].view(1, len(keys), 2, self.n_kv, hd)
        else:
            kv = torch.index_select(data, 0, keys.view(-1)).view(*keys.shape, 2, self.n_kv, hd)  # (size, K, 2, nkv, hd)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (size, nkv, K, hd)
        q = (q if g.q_index is None else q[g.q_index]).view(g.size, g.rows, nh, hd).transpose(1, 2)
        mask = g.masks[kind]
        if g.fold > 1:  # each KV head's query heads as one block of rows (lean_step.fold_heads)
            q = q.reshape(g.size, self.n_kv, g.fold * g.rows, hd)
        if self.softcap is not None:
            y = capped_attention(q, k, v, mask, self.softcap, self.scale)
        else:
            # 4-D: with 3-D inputs PyTorch's CPU dispatch takes the unfused
            # "math" attention, ~3.5x slower per call (334 vs 94 us for 5
            # queries x 155 keys).
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and g.causal,
                scale=self.scale,
                enable_gqa=q.shape[1] != self.n_kv,  # folded: one query block per KV head already
            )
        return y.reshape(g.size, nh, g.rows, hd).transpose(1, 2).reshape(g.size * g.rows, nh * hd)

    def _mlp(self, L: dict, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP block (SwiGLU / GeGLU), (R, C)."""
        h = self._rms(x, L["ln2"])
        gate, up = L["gate_up"](h).chunk(2, dim=-1)
        out = L["down"](self._act(gate) * up)
        return out if L["post_ff"] is None else self._rms(out, L["post_ff"])

    def _logits(
        self, x: torch.Tensor, sizes: list[int], last_only: bool | list[bool], keep: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Final norm and LM head over the rows wanted (keep: the step's,
        None: all): every row, or each item's last where last_only says so;
        one (n or 1, V) float tensor per item."""
        if keep is not None:
            flags = last_only if isinstance(last_only, list) else [True] * len(sizes)
            x = x[keep]
            sizes = [1 if last else n for n, last in zip(sizes, flags)]
        logits = self.head(self._rms(x, self.norm))
        if self.final_softcap is not None:  # Gemma: in the model dtype, before the cast, as HF
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return list(logits.float().split(sizes))
