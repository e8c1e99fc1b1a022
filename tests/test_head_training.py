"""The heads trained here are served as trained: training/eagle3.py's and
training/medusa.py's modules, saved in the published formats, give the same
distributions through the serving drafter as the modules they were trained as
(random weights, the demo target). A trainer whose forward differed from the
served one (another RoPE position, a missing norm, heads one token off) would
train a head that drafts something else."""

from pathlib import Path

import numpy as np
import pytest
import torch

from drafter_svc.config import DrafterConfig
from drafter_svc.eagle import make_drafter
from specd_core.rules.sampling import SamplingParams
from specd_core.runtime.eagle_head import HeadConfig
from specd_core.runtime.head_formats import aux_layer_ids, head_format
from training.eagle import unroll_masks
from training.eagle3 import Eagle3Head, draft_vocabulary
from training.eagle3 import save as save_eagle3
from training.medusa import MedusaHeads
from training.medusa import save as save_medusa
from verifier_svc.config import VerifierConfig
from verifier_svc.core import Verifier

TARGET = Path(__file__).resolve().parents[1] / "models/demo/target"
PROMPT, FIRST = [40, 41, 42, 43, 44, 45, 46, 47], 17


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def _randomised(module: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights, rounded to fp16 (what the saved files hold)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_((p + noise if p.dim() == 1 else noise).half().float())


def _wire(aux):
    v = Verifier(VerifierConfig(str(TARGET), device="cpu"))
    return v.open_session("s", PROMPT, SamplingParams(0.0), hidden=aux)[1]


@pytest.mark.unit
@torch.inference_mode()
def test_trained_eagle3_module_is_what_the_drafter_serves(target, tmp_path):
    tc = target.config
    aux = aux_layer_ids({}, tc.num_hidden_layers)
    rng = np.random.default_rng(0)
    draft_ids = draft_vocabulary(rng.zipf(1.3, 50_000) % tc.vocab_size, tc.vocab_size, 1000)
    assert len(draft_ids) == 1000 and bool((draft_ids[1:] > draft_ids[:-1]).all())
    assert int(draft_ids[-1]) > 999  # not the first 1000 ids: d2t is a real offset table
    head = Eagle3Head(HeadConfig.from_target(tc), tc.hidden_size, len(draft_ids))
    _randomised(head, 1, 0.05)
    save_eagle3(head, tmp_path, draft_ids, tc.vocab_size, list(aux), {})
    assert head_format(tmp_path) == "eagle3"

    # The trainer's view: level 0 over the committed rows, then one unrolled level.
    wire = _wire(aux)
    tokens = PROMPT[1:] + [FIRST]
    n = len(tokens)
    embed = target.model.embed_tokens.weight

    def on_target_ids(logits):
        full = torch.full((tc.vocab_size,), float("-inf"))
        full[draft_ids] = logits
        return full.softmax(-1)

    out0, kv = head.rows(embed[torch.tensor([tokens])], head.fc(wire.decode()[None]), torch.arange(n))
    want0 = on_target_ids(head.logits(out0)[0, -1])
    y1 = int(want0.argmax())
    mask = unroll_masks(n, 2)[1]
    out1, _ = head.rows(embed[torch.tensor([tokens[1:] + [y1]])], out0, torch.arange(1, n + 1), kv, mask)
    want1 = on_target_ids(head.logits(out1)[0, -1])

    d = make_drafter(DrafterConfig(str(tmp_path), target_dir=str(TARGET), device="cpu"))
    runner = d.runner
    s = runner.new_session()
    got0 = runner.feed_batch([(s, tokens, wire.decode())])[0][-1].softmax(-1)
    got1 = runner.forward_batch([(s, [y1], None, None)])[0][-1].softmax(-1)
    for got, want in ((got0, want0), (got1, want1)):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        assert float(got[~torch.isin(torch.arange(tc.vocab_size), draft_ids)].sum()) == 0.0


@pytest.mark.unit
@torch.inference_mode()
def test_trained_medusa_heads_are_what_the_drafter_serves(target, tmp_path):
    tc = target.config
    heads = MedusaHeads(tc.hidden_size, target.lm_head.weight, 3, 2)
    _randomised(heads, 2, 0.05)
    save_medusa(heads, tmp_path, tc.hidden_size, tc.vocab_size, {})
    assert head_format(tmp_path) == "medusa"

    wire = _wire(True)  # the last layer's output before the final norm
    after_norm = target.model.norm(wire.decode()[-1:])  # what the trainer reads: HF's last hidden state
    want = [heads.logits(i, after_norm)[0].softmax(-1) for i in range(3)]

    d = make_drafter(DrafterConfig(str(tmp_path), target_dir=str(TARGET), device="cpu", engine="lean"))
    runner, s = d.runner, d.runner.new_session()
    got = [runner.feed_batch([(s, PROMPT[1:] + [FIRST], wire.decode())])[0][-1].softmax(-1)]
    for _ in range(2):  # depth d reads head d - 1 whatever the token
        got.append(runner.forward_batch([(s, [int(got[-1].argmax())], None, None)])[0][-1].softmax(-1))
    for q, p in zip(got, want):
        assert torch.allclose(q, p, atol=1e-4), (q - p).abs().max()
