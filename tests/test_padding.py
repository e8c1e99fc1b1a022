"""training.pad_target must grow a Llama without changing what it computes."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from training.pad_target import main as pad_cli
from training.pad_target import n_params, pad_model

pytestmark = pytest.mark.unit

torch.set_num_threads(1)


def _tiny(tmp_path):
    """A tiny random Llama saved and reloaded like the real target (tied embeddings)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    # Non-trivial norm weights so a mistake in copying them would show.
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "src")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def _inputs():
    return torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


def test_pad_adds_layers_and_width_and_keeps_logits(tmp_path):
    model = _tiny(tmp_path)
    want = 10 * n_params(model)
    padded = pad_model(model, want)
    assert n_params(padded) >= want
    assert padded.config.num_hidden_layers == 4  # default: double the depth...
    assert padded.config.intermediate_size > 64  # ...then widen to reach the count
    x = _inputs()
    torch.testing.assert_close(_logits(padded, x), _logits(model, x), atol=1e-5, rtol=0)


def test_pad_layers_only_keeps_logits(tmp_path):
    model = _tiny(tmp_path)
    want = 2 * n_params(model)
    padded = pad_model(model, want, num_layers=16)
    assert n_params(padded) >= want
    assert padded.config.intermediate_size == 64  # depth alone was enough
    x = _inputs()
    torch.testing.assert_close(_logits(padded, x), _logits(model, x), atol=1e-5, rtol=0)


def test_pad_keeps_kv_cached_decoding(tmp_path):
    model = _tiny(tmp_path)
    padded = pad_model(model, 5 * n_params(model))
    x = _inputs()[:1]
    outs = []
    for m in (model, padded):
        out = m(input_ids=x[:, :30], use_cache=True)
        step = m(input_ids=x[:, 30:], cache=out.cache, use_cache=True)
        outs.append(step.logits)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)


def test_cli_roundtrip(tmp_path):
    model = _tiny(tmp_path)
    want = 8 * n_params(model)
    pad_cli([str(tmp_path / "src"), str(tmp_path / "dst"), "--min-params", str(want),
             "--dtype", "float32"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    assert n_params(loaded) >= want
    x = _inputs()
    torch.testing.assert_close(_logits(loaded, x), _logits(model, x), atol=1e-5, rtol=0)
