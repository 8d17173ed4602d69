"""load_hf for Llama / Mistral folders: transformers' own save_pretrained output (offline, random
weights) read into our model gives transformers' logits, and a rank's slices of our fused
parameters are read element for element from the right rows of q/k/v and up/gate, nothing more."""
from __future__ import annotations

import pytest
import torch

from megatron.build import load_hf_weights
from megatron.checkpointing.hf_llama import from_llama_state_dict
from megatron.checkpointing.hf_weights import HFWeights
from megatron.model import GPTNeoX
from test_llama_parity import SHAPES, hf_model, llama_cfg, tokens

transformers = pytest.importorskip("transformers")
# GQA untied with no biases; MHA tied with biases (per-head q/k/v rows); Mistral: MQA, window, tied.
CASES = ["gqa", "mha_tied_biases", "mistral_window_mqa_tied"]


@pytest.fixture(scope="module", params=CASES)
def saved(request, tmp_path_factory):
    cfg = llama_cfg(**SHAPES[request.param])
    hf = hf_model(cfg)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(folder))
    return request.param, cfg, hf, folder


def test_the_folder_reads_as_our_config_and_gives_transformers_logits(saved):
    name, cfg, hf, folder = saved
    weights = HFWeights(folder)
    got = weights.model_cfg
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "norm", "activation",
                "use_bias_in_attn_linear", "use_bias_in_mlp", "sliding_window_width", "no_weight_tying"):
        assert getattr(got, key) == getattr(cfg, key), key
    assert (got.rms_norm_epsilon, got.rotary_emb_base) == (cfg.rms_norm_epsilon, cfg.rotary_emb_base)
    ours = GPTNeoX(got).eval()
    load_hf_weights(ours, str(folder))
    x = tokens(cfg.seq_length)
    with torch.no_grad():
        diff = (ours(x) - hf(x).logits).abs().max().item()
    assert diff < 2e-5, (name, diff)


def test_slices_read_only_their_elements(saved):
    name, cfg, hf, folder = saved
    full = from_llama_state_dict(hf.state_dict(), cfg)
    weights = HFWeights(folder)
    gen = torch.Generator().manual_seed(0)
    asked = 0
    for our_name, shape in weights.shapes().items():
        assert tuple(full[our_name].shape) == shape, our_name
        flat = full[our_name].reshape(-1)
        for _ in range(3):
            lo, hi = sorted(torch.randint(0, flat.numel() + 1, (2,), generator=gen).tolist())
            assert torch.equal(weights.read(our_name, lo, hi), flat[lo:hi]), (our_name, lo, hi)
            asked += hi - lo
    assert weights.elements_read == asked
