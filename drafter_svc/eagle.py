"""Method eagle: the drafter core drafting with an EAGLE head
(specd_core/runtime/eagle_head.py; Li et al. 2024) on the target's own features.

What differs from a draft model, and nothing else (tree growth, q for sampled
children, batching are the draft_model code, drafter_svc/tree_builder.py):

* The head's KV row i is the pair (x_{i+1}, f_i): a committed token and the
  target's feature of the token before it. The verifier sends the features of
  the tokens it committed (all but the newest, which it has not forwarded yet),
  so after each Propose the head holds exactly one row per known feature and
  its last row's output predicts the token after the last committed one.
* Draft rows are fed the head's OWN predicted feature of their parent (EAGLE's
  autoregression on features): each row's output feature is kept in the
  runner's feature store at the row's KV slot (`HeadRunner.features`), and a
  drafted row's parent is the latest earlier row it attends to (the tree
  builders forward a node only after its ancestors; a chain level has one row).
* The rows of the last tree were computed from predicted features, so the next
  Propose drops them all and re-forwards the kept path with the true features
  that came back from the verifier (EAGLE does the same); the draft_model core
  instead keeps the accepted path's rows.
* No pipelined (`ahead`) drafting: the next draft needs the verify's features.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from drafter_svc.core import Drafter
from drafter_svc.eagle_published import build_published
from drafter_svc.head_input import Eagle3Input, FusedInput
from drafter_svc.state import DraftSession, ProposeJob, commit
from specd_core.errors import InvalidRequest
from specd_core.runtime.eagle_head import CONFIG_NAME, load_head
from specd_core.runtime.head_formats import METHOD_OF, head_format
from specd_core.runtime.kv_budget import KVPool
from specd_core.runtime.lean import LeanModel
from specd_core.runtime.models import ModelRunner, resolve_device, torch_dtype
from specd_core.runtime.propose_call import ProposeCall
from specd_core.runtime.tree_tensors import TreeLevel

HeadRule = FusedInput | Eagle3Input  # drafter_svc/head_input.py


def head_target_dir(head_dir: str, target_dir: str = "") -> str:
    """The target directory whose embedding / final norm / LM head the head
    shares: given, else the head's config `target` (relative to the head)."""
    if target_dir:
        return target_dir
    rel = json.loads((Path(head_dir) / CONFIG_NAME).read_text()).get("target")
    if not rel:
        raise ValueError(f"{head_dir}: the head names no target; give the target directory (--target-dir)")
    return str((Path(head_dir) / rel).resolve())


def build_head_model(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default"):
    """A one-layer Llama carrying the head's decoder layer and the TARGET's
    embedding, final norm and LM head, so the lean forward (specd_core/runtime/lean.py) runs
    the head's layer and the target's output layer as it runs any model; and
    its input rule, fc([embed; feature]). Returns (hf_model, FusedInput)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    head = load_head(head_dir)
    c = head.config
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    if target.config.hidden_size != c.hidden_size or target.config.vocab_size != c.vocab_size:
        raise ValueError(
            f"head {head_dir} (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit target "
            f"{target_dir} (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})"
        )
    cfg = LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        eos_token_id=target.config.eos_token_id,
        bos_token_id=target.config.bos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    layer, src = model.model.layers[0], head.layer
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        model.model.norm.weight.copy_(target.model.norm.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
        layer.input_layernorm.weight.copy_(src.input_layernorm)
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
    # "auto" (and "default" on a GPU): the target's checkpoint dtype, as the head
    # shares its output layer.
    dev = resolve_device(device)
    dt = torch_dtype(target_dir, dtype, dev)
    return model.to(dev, dt).eval(), FusedInput(head.fc.weight.detach().to(dev, dt))


def build_any_head(head_dir: str, target_dir: str, device: str = "auto", dtype: str = "default"):
    """(one-layer model, input rule) of a head directory in any format
    (specd_core/runtime/head_formats.py)."""
    if head_format(head_dir) == "specd":
        return build_head_model(head_dir, target_dir, device, dtype)
    return build_published(head_dir, target_dir, device, dtype)


class HeadSession:
    """The head's KV rows (a LeanSession) and, in the runner's feature store at
    the same storage slots, each row's output feature."""

    def __init__(self, runner: HeadRunner, kv):
        self.runner, self.kv = runner, kv

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def feats(self) -> torch.Tensor:
        """A copy of the rows' features in row order, (length, C) (tests, tools)."""
        store = self.runner.features(self.kv.store)
        return store[torch.tensor(self.kv.slots(0, self.length), dtype=torch.long, device=store.device)]

    def parent_slots(self, n: int, mask) -> list[int] | torch.Tensor:
        """The storage slot of the feature each of n new drafted rows reads: its
        parent's output, the latest cached row it attends to. Host integers for
        a chain row and a tree level (all sessions' go to the device at once);
        a dense mask (ahead branches) is read on the device."""
        start = self.length
        if mask is None:
            if n != 1:
                raise ValueError("drafted rows go through the head one tree level at a time")
            return [self.kv.slot(start - 1)]
        if isinstance(mask, TreeLevel):
            return [self.kv.slot(r) for r in mask.parents()]
        seen = mask[:, :start] == 0  # (n, start)
        order = torch.arange(1, start + 1, device=seen.device)
        slots = torch.tensor(self.kv.slots(0, start), dtype=torch.long, device=seen.device)
        return slots[(seen * order).argmax(-1)]

    def forward(self, token_ids: list[int], last_only: bool = False, positions=None, mask=None) -> torch.Tensor:
        return self.runner.forward_batch([(self, token_ids, positions, mask)], last_only)[0]

    def rollback(self, length: int) -> None:
        self.kv.rollback(length)

    def reserve(self, rows: int, what: str = "a session") -> None:
        self.kv.reserve(rows, what)

    def release(self) -> None:
        self.kv.release()

    @torch.inference_mode()
    def compact(self, start: int, keep: list[int]) -> None:
        moved = [(self.kv.slot(start + k), self.kv.slot(start + j)) for j, k in enumerate(keep) if k != j]
        if moved:
            store = self.runner.features(self.kv.store)
            pairs = torch.tensor(moved, dtype=torch.long, device=store.device)
            store[pairs[:, 1]] = store[pairs[:, 0]]
        self.kv.compact(start, keep)


class HeadRunner:
    """The head as a Runner (new_session / forward_batch), which is all the
    tree builders need: input rows are fc([embed(token); feature])."""

    engine = "lean"

    def __init__(self, lean: LeanModel, rule: HeadRule):
        self.lean, self.rule = lean, rule  # the one-layer model (build_any_head) and its input rule
        self.hidden_size = rule.hidden_size  # the head's own features
        self.feature_width = rule.feature_width  # the verifier's features, per token
        self.vocab_size = int(lean.embed.shape[0])  # the ids it drafts: the target's
        self.kv_pool: KVPool | None = None  # the drafter's KV budget (the drafter core installs it)
        self.kv_dtype = lean.kv_dtype
        # A session's rows hold K and V and, beside them, each row's output feature.
        self.kv_row_bytes = lean.kv_row_bytes + self.hidden_size * lean.embed.element_size()
        # Each row's output feature, at the row's slot in the KV pool's storage:
        # a tree level reads all sessions' parents and stores all their rows
        # with one indexed read and one indexed write.
        self._features: torch.Tensor | None = None

    def new_session(self) -> HeadSession:
        return HeadSession(self, self.lean.new_session(pool=self.kv_pool))

    @torch.inference_mode()
    def features(self, store) -> torch.Tensor:
        """The feature store, as many rows as the KV storage `store` (grown with it)."""
        rows = store.data.shape[1]
        have = self._features
        if have is None or have.shape[0] < rows:
            # Not zeroed: like the KV storage, its pages are touched only as
            # rows are written, and a row is read only after its forward wrote it.
            grown = torch.empty(rows, self.hidden_size, dtype=self.lean.dtype, device=self.lean.device)
            if have is not None:
                grown[: have.shape[0]] = have
            self._features = have = grown
        return have

    def _slots(self, lists: list) -> slice | torch.Tensor:
        """Per-session slots (host lists or device tensors) as one index of the
        store: a slice when they are one run of consecutive slots (a lone
        session's chain row, its rows within a block: no upload), else one
        device tensor."""
        dev = self.lean.device
        if all(isinstance(x, list) for x in lists):
            flat = [i for x in lists for i in x]
            if flat and flat[-1] - flat[0] == len(flat) - 1 and all(b == a + 1 for a, b in zip(flat, flat[1:])):
                return slice(flat[0], flat[-1] + 1)
            return torch.tensor(flat, dtype=torch.long, device=dev)
        return torch.cat([torch.as_tensor(x, dtype=torch.long, device=dev) for x in lists])

    @torch.inference_mode()
    def _run(self, items: list, feats: torch.Tensor, last_only: bool) -> list[torch.Tensor]:
        ids = torch.tensor([t for _, toks, _, _ in items for t in toks], device=self.lean.device)
        x = self.rule.rows(self.lean, ids, feats)  # (R, C)
        starts = [s.length for s, *_ in items]
        logits, states = self.lean.forward_embeds(
            [(s.kv, toks, p, m) for s, toks, p, m in items], x, last_only, hidden=True
        )
        # The rows the forward just appended (their blocks taken by its plan).
        writes = [s.kv.slots(start, s.length) for (s, *_), start in zip(items, starts)]
        store = self.features(items[0][0].kv.store)
        store[self._slots(writes)] = torch.cat(states).to(store.dtype)
        return self.rule.to_target(logits)

    def forward_batch(self, items: list, last_only: bool = False) -> list[torch.Tensor]:
        """Drafted rows: items (HeadSession, token_ids, positions | None, mask | None)."""
        if not items:
            return []
        store = self.features(items[0][0].kv.store)
        feats = store[self._slots([s.parent_slots(len(toks), m) for s, toks, _, m in items])]
        return self._run(items, feats, last_only)

    def feed_batch(self, items: list) -> list[torch.Tensor]:
        """Committed rows: items (HeadSession, token_ids, target features (n, C)),
        row i = (token_ids[i], features[i]); each one's logits after its last row."""
        if not items:
            return []
        feats = self.rule.committed(torch.cat([f for *_, f in items]).to(self.lean.device))
        return self._run([(s, toks, None, None) for s, toks, _ in items], feats, last_only=True)


class Eagle:
    """The drafting method of an EAGLE head (drafter_svc/method.py; the module
    docstring says what differs). Built from the head's directory: the head
    model the drafter core runs (`model`), and on the core's runner the
    HeadRunner it drafts through."""

    name = "eagle"  # or "eagle3" (the head's format says which)
    # Every call of a head needs the target's features, which a replica alone
    # does not have: no warm-up (its first calls pay their one-off costs; the
    # orchestrator's cost model clips them, orchestrator/cycle/adaptive.py).
    warms_up = False

    def __init__(self, config, built=None):
        if config.engine == "hf":
            raise ValueError("method eagle runs on the lean engine")
        fmt = head_format(config.model_dir) or "specd"
        self.name = METHOD_OF[fmt]
        # The target it shares embedding (and LM head) with: given, else a specd head's own config names it.
        self.tokenizer_dir = config.target_dir or (head_target_dir(config.model_dir) if fmt == "specd" else "")
        if not self.tokenizer_dir:
            raise ValueError(f"{config.model_dir}: a published {fmt} head needs its target directory (--target-dir)")
        self.model, self.rule = built or build_any_head(
            config.model_dir, self.tokenizer_dir, config.device, config.dtype
        )
        self.runner: HeadRunner | None = None  # made with the core (runner_of)
        self.format = fmt

    def describe(self) -> str:
        what = {"specd": "specd's own", "eagle": "published EAGLE-1/2", "eagle3": "published EAGLE-3"}[self.format]
        out = f"{self.name}: {what} {'EAGLE ' if self.format == 'specd' else ''}head"
        ids = getattr(self.rule, "target_ids", None)  # a draft vocabulary of its own (EAGLE-3)
        if ids is not None:
            out += f", draft vocabulary {len(ids)} of the target's {self.rule.vocab_size}"
        return out

    def runner_of(self, runner: ModelRunner) -> HeadRunner:
        """The head reads features too: its runner wraps the lean forward of
        the one-layer model (the KV budget is then sized by its rows: K, V and
        a feature)."""
        if runner.lean is None:
            raise ValueError("method eagle runs on the lean engine")
        self.runner = HeadRunner(self.rule.lean_of(runner), self.rule)
        return self.runner

    def check_vocab(self, asked: int, target_vocab: int, own: int) -> None:
        if target_vocab != own:
            # The head's table is the target's own (build_head_model checks it).
            raise InvalidRequest(
                f"target_vocab_size {asked} differs from the head's {own} "
                f"(an EAGLE head drafts over its target's vocabulary)"
            )

    def prefill(self, s: DraftSession, session_id: str, prompt_ids: list[int]) -> None:
        """Nothing to prefill yet: the head needs the prompt's features, which
        come from the verifier's prefill with the first Propose."""

    def admit(self, call: ProposeCall) -> ProposeCall:
        # forced_room is not taken: the head's forwards read one predicted
        # feature per token, so a forced run would cost a level per token
        # anyway; its masked q drafts forced positions (q = 1) as it goes.
        if call.ahead or call.rewind or call.alternatives or call.branch:
            raise InvalidRequest(f"method {self.name} does not draft ahead (pipelined drafting is for draft_model)")
        return dataclasses.replace(call, hidden=None, forced_room=0)

    def ready(self, job: ProposeJob, call: ProposeCall) -> ProposeJob:
        """The job with the features of the tokens committed before the newest, decoded."""
        assert self.runner is not None  # made with the core
        s, hidden = job.session, call.hidden
        need = len(s.tokens) + len(job.committed) - 1 - s.base  # features not yet fed
        got = hidden.rows if hidden is not None else 0
        if need < 1 or got != need:
            raise InvalidRequest(
                f"method {self.name}: hidden_states must hold the features of the {need} tokens "
                f"committed before the newest, got {got} rows"
            )
        assert hidden is not None  # got == need >= 1
        if hidden.hidden_size != self.runner.feature_width:
            raise InvalidRequest(
                f"hidden_states are {hidden.hidden_size} wide; the head reads {self.runner.feature_width}"
            )
        try:
            job.hidden = hidden.decode()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if not torch.isfinite(job.hidden).all():
            raise InvalidRequest("hidden_states hold non-finite values")
        return job

    def catch_up(self, j: ProposeJob) -> None:
        # The last tree's rows were computed on predicted features: drop them
        # all; the kept path comes back below with the target's true features.
        s = j.session
        s.cache.rollback(s.base)
        commit(s, j.committed)

    def root_logits(self, forwards, live: list[ProposeJob]) -> list[torch.Tensor]:
        assert self.runner is not None  # made with the core
        items = []
        for j in live:
            s, rows = j.session, j.session.cache.length
            assert j.hidden is not None  # ready refuses a call without the features
            items.append((s.cache, s.tokens[rows + 1 : rows + 1 + j.hidden.shape[0]], j.hidden))
        return self.runner.feed_batch(items)


def make_drafter(config, model=None) -> Drafter:
    """The core a drafter directory asks for: on an EAGLE head directory the
    Drafter drafting with it (model: (head model, input rule) already built), on
    Medusa heads the Drafter drafting with them (drafter_svc/medusa.py; model:
    the MedusaModel already built), on a causal LM the draft_model Drafter."""
    fmt = head_format(config.model_dir)
    if fmt == "medusa":
        from drafter_svc.medusa import Medusa, with_any_engine  # it builds on this module

        config = with_any_engine(config)
        medusa = Medusa(config, model)
        return Drafter(config, medusa.model, medusa)
    if fmt:
        eagle = Eagle(config, model)
        return Drafter(config, eagle.model, eagle)
    return Drafter(config, model)
