"""Method medusa: the drafter core drafting with published Medusa heads
(Cai et al. 2024; specd_core/runtime/medusa_format.py) on the target's features.

Offsets. In Medusa the target's LM head on its hidden state h_t gives token
t+1 and Medusa head i gives token t+2+i. specd's verifier decides the next
token itself (the bonus or correction) and then sends the features of the
tokens committed BEFORE the newest one (drafter_svc/eagle.py), so with
committed tokens x_0..x_n the newest feature is h_{n-1}, whose own next token
x_n is already committed. The drafted tokens after x_n therefore are:

    depth 1 (x_{n+1}): head 0 on h_{n-1}
    depth d (x_{n+d}): head d-1 on h_{n-1}

exactly Medusa's own offsets, so K heads draft at most K deep (a deeper shape
is cut to K levels). A node's children are drawn from head (depth)'s softmax
under the session's sampling parameters whatever the node's token: Medusa's
approximation, which costs acceptance but not exactness, because the q
that travels with each sampled child is the law it was drawn from.

Trees: a static tree given node by node (`tree.paths`, also read from the
speculative config's `medusa_choices`) is Medusa's tree: child k of a node
at depth d is head d's k-th choice. Chains and dynamic trees work as for the
other drafters. The heads hold no KV: a session keeps its token count, the
length at its last verdict and the one feature the heads read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafter_svc.eagle import Eagle
from drafter_svc.state import ProposeJob
from specd_core.runtime.head_formats import fit_problem, read_config
from specd_core.runtime.kv_budget import KVPool
from specd_core.runtime.medusa_format import MedusaWeights, load_medusa
from specd_core.runtime.models import ModelRunner, resolve_device, torch_dtype
from specd_core.runtime.propose_call import ProposeCall
from specd_core.runtime.tree_tensors import TreeLevel


class MedusaModel(nn.Module):
    """The heads, and the target's final norm that the verifier's features
    (taken before it) still need. `config` is what the drafter core reads:
    the target's context, vocabulary and end tokens."""

    def __init__(self, w: MedusaWeights, target, device, dtype: torch.dtype):
        from transformers import PretrainedConfig

        super().__init__()
        tc = target.config

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device, dtype)

        self.residual = [[(put(wt), None if b is None else put(b)) for wt, b in layers] for layers in w.residual]
        self.lm_heads = [put(lm) for lm in w.lm_heads]
        self.token_map = None if w.token_map is None else w.token_map.to(device)
        self.logit_scale, self.layout = w.logit_scale, w.layout
        self.norm, self.eps = put(target.model.norm.weight), tc.rms_norm_eps
        self.hidden_size, self.vocab_size = tc.hidden_size, tc.vocab_size
        self.config = PretrainedConfig(
            architectures=["MedusaModel"],
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            max_position_embeddings=tc.max_position_embeddings,
            eos_token_id=tc.eos_token_id,
            bos_token_id=tc.bos_token_id,
        )
        self._device, self._dtype = torch.device(device), dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def feature(self, hidden: torch.Tensor) -> torch.Tensor:
        """The verifier's feature (before the target's final norm) as the heads read it: after it."""
        x32 = hidden.to(self.device).float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(self.dtype) * self.norm

    @torch.inference_mode()
    def logits(self, head: int, x: torch.Tensor) -> torch.Tensor:
        """Head `head` on features (S, C): logits over the target's ids (S, V);
        ids outside a truncated vocabulary get -inf (q gives them no mass)."""
        for weight, bias in self.residual[head]:
            x = x + F.silu(F.linear(x, weight, bias))
        lg = F.linear(x, self.lm_heads[head])
        if self.logit_scale != 1.0:
            lg = lg * self.logit_scale
        if self.token_map is None:
            return lg
        full = lg.new_full((lg.shape[0], self.vocab_size), float("-inf"))
        full[:, self.token_map] = lg
        return full


class MedusaSession:
    """A session as the tree builders see it: a row count (no KV), the count at
    the last verdict (`committed`: depth 1 is the row after it) and the feature."""

    def __init__(self, runner: MedusaRunner):
        self.runner, self.length, self.committed = runner, 0, 0
        self.feature: torch.Tensor | None = None

    def forward(self, token_ids: list[int], last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        return self.runner.forward_batch([(self, token_ids, positions, mask)], last_only)[0]

    def head_of_rows(self, n: int, positions) -> list[int]:
        """The head whose logits each new row gets: a row at depth d (position
        committed - 1 + d; a chain's rows follow the cache) has children at d + 1."""
        if positions is None:
            positions = range(self.length, self.length + n)
        pos = positions.tolist() if isinstance(positions, torch.Tensor) else positions
        last = self.runner.model.num_heads - 1
        # Rows past the last head occur only for shapes deeper than the heads,
        # which Medusa.ready cuts; any head's law would still be exact there.
        return [min(max(p - self.committed + 1, 0), last) for p in pos]

    def rollback(self, length: int) -> None:
        self.length = length

    def compact(self, start: int, keep: list[int]) -> None:
        self.length = start + len(keep)

    def reserve(self, rows: int, what: str = "a session") -> None:
        """Nothing to reserve: the heads keep no rows."""

    def release(self) -> None:
        self.feature = None


class MedusaRunner:
    """The heads as a Runner (new_session / forward_batch / feed_batch), what
    the tree builders and the EAGLE method's steps call."""

    engine = "medusa"

    def __init__(self, model: MedusaModel):
        self.model = model
        # Not None: the sessions' levels are batched (drafter_svc/core.py). No
        # lean forward runs through it (the heads are not a LeanModel).
        self.lean: Any = model
        self.hidden_size = self.feature_width = model.hidden_size
        self.vocab_size = model.vocab_size
        self.kv_pool: KVPool | None = None  # installed by the core; the sessions take nothing from it
        self.kv_dtype = model.dtype
        # The sessions take no block (only max_sessions limits them), but the
        # pool is still built from a budget in bytes: priced at one feature per
        # row it stays the size of other drafters' (at 1 byte a row, a 10 GiB
        # budget made a free list of 168 million blocks: gigabytes and seconds).
        self.kv_row_bytes = model.hidden_size * torch.finfo(model.dtype).bits // 8

    def new_session(self) -> MedusaSession:
        return MedusaSession(self)

    def _heads(self, wanted: list[tuple[MedusaSession, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """Each (session, head) pair's logits row, one batched pass per head."""
        by_head: dict[int, list[MedusaSession]] = {}
        for s, h in dict.fromkeys((s, h) for s, h in wanted):
            by_head.setdefault(h, []).append(s)
        out: dict[tuple[int, int], torch.Tensor] = {}
        for h, sessions in by_head.items():
            assert all(s.feature is not None for s in sessions)  # fed before any draft row
            rows = self.model.logits(h, torch.stack([s.feature for s in sessions]))  # type: ignore[misc]
            out |= {(id(s), h): r for s, r in zip(sessions, rows)}
        return out

    def forward_batch(self, items: list, last_only: bool = False) -> list[torch.Tensor]:
        """Drafted rows: items (MedusaSession, token_ids, positions | None, mask | None)."""
        heads = [
            s.head_of_rows(len(toks), m.positions if isinstance(m, TreeLevel) else pos) for s, toks, pos, m in items
        ]
        got = self._heads([(s, h) for (s, *_), hs in zip(items, heads) for h in hs])
        out = []
        for (s, toks, *_), hs in zip(items, heads):
            rows = torch.stack([got[(id(s), h)] for h in (hs[-1:] if last_only else hs)])
            s.length += len(toks)
            out.append(rows)
        return out

    def feed_batch(self, items: list) -> list[torch.Tensor]:
        """Committed rows: items (MedusaSession, token_ids, target features (n, C));
        the newest feature is what the heads read; each one's head-0 logits (1, V)."""
        for s, toks, feats in items:
            s.length += len(toks)
            s.committed = s.length
            s.feature = self.model.feature(feats[-1])
        got = self._heads([(s, 0) for s, *_ in items])
        return [got[(id(s), 0)][None] for s, *_ in items]


def build_medusa(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default") -> MedusaModel:
    """The heads of a published Medusa directory, checked against the target
    (ValueError naming the mismatch), on the target's device and dtype."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    problem = fit_problem(head_dir, target.config)
    if problem:
        raise ValueError(problem)
    dev = resolve_device(device)
    return MedusaModel(load_medusa(head_dir, read_config(head_dir)), target, dev, torch_dtype(target_dir, dtype, dev))


class Medusa(Eagle):
    """The drafting method of Medusa heads (module docstring): EAGLE's steps
    (features checked and fed with each Propose, no drafting ahead, the tree's
    rows dropped at the verdict) with the heads' runner, and shapes cut to
    the heads' depth."""

    name = "medusa"

    def __init__(self, config, built: MedusaModel | None = None):
        # Not Eagle's: there is no one-layer model or input rule to build.
        self.tokenizer_dir = config.target_dir
        if not self.tokenizer_dir:
            raise ValueError(f"{config.model_dir}: a published medusa head needs its target directory (--target-dir)")
        self.model = built or build_medusa(config.model_dir, self.tokenizer_dir, config.device, config.dtype)
        self.runner = None

    def describe(self) -> str:
        m = self.model
        rows = m.lm_heads[0].shape[0]
        vocab = f", draft vocabulary {rows} of the target's {m.vocab_size}" if m.token_map is not None else ""
        return f"medusa: {m.num_heads} published Medusa heads ({m.layout} layout){vocab}"

    def runner_of(self, runner: ModelRunner) -> MedusaRunner:  # type: ignore[override]
        """The heads run on their own (the model's Runner is not used)."""
        self.runner = MedusaRunner(self.model)  # type: ignore[assignment]
        return self.runner  # type: ignore[return-value]

    def ready(self, job: ProposeJob, call: ProposeCall) -> ProposeJob:
        job = super().ready(job, call)
        shape = job.shape.truncated(self.model.num_heads)
        return dataclasses.replace(job, shape=shape) if shape is not None and shape != job.shape else job


def with_any_engine(config):
    """The heads run on neither engine: the core's Runner over the heads'
    config must not refuse an explicit `lean`."""
    return dataclasses.replace(config, engine="auto") if config.engine != "auto" else config
