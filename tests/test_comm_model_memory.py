"""Memory model against hand-computed tables, and GPT-NeoX unit sizes."""
import pytest

from megatron.topology.layout import ShardLayout
from megatron.analytic.comm_model import CommSpec
from megatron.analytic.memory_model import neox_unit_sizes, predict_model_state_bytes

UNITS = (100, 240, 240, 96)
LAYOUT = (2, 2, 2)

# Per rank, fp32 (c = 4). Every preset pads to q = N = 8: S = 104, 240, 240, 96, sum 680.
# weights S/w x 4, grad accumulator S/g x 4, master S/os x 4, moments 2 x S/os x 4.
EXPECTED = {
    # (1,1,1): 680 x 4 = 2720 for weights, grads and master; moments 5440; total 3 x 2720 + 5440 = 13600
    "stage0": dict(weights=2720, secondary=0, grad_accumulator=2720, master=2720, moments=5440, total=13600),
    # (1,1,8): weights 680 x 4 = 2720, grads 2720, master 85 x 4 = 340, moments 680; total 6460
    "stage1": dict(weights=2720, secondary=0, grad_accumulator=2720, master=340, moments=680, total=6460),
    # (1,8,8): weights 2720, grads 340, master 340, moments 680; total 4080
    "stage2": dict(weights=2720, secondary=0, grad_accumulator=340, master=340, moments=680, total=4080),
    # (8,8,8): 85 x 4 = 340 each, moments 680; total 1700
    "stage3": dict(weights=340, secondary=0, grad_accumulator=340, master=340, moments=680, total=1700),
    # (4,4,4): S/4 = 26 + 60 + 60 + 24 = 170 -> 170 x 4 = 680 each, moments 1360; total 3 x 680 + 1360 = 3400
    "hsdp": dict(weights=680, secondary=0, grad_accumulator=680, master=680, moments=1360, total=3400),
    # (2,4,8): weights 340 x 4 = 1360, grads 170 x 4 = 680, master 85 x 4 = 340, moments 680; total 3060
    "zero_topo": dict(weights=1360, secondary=0, grad_accumulator=680, master=340, moments=680, total=3060),
    # zeropp: everything over N = 8 (340), secondary S/R = 170 x 4 = 680; total 340 x 3 + 680 + 680 = 2380
    "zeropp": dict(weights=340, secondary=680, grad_accumulator=340, master=340, moments=680, total=2380),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_hand_computed_memory(preset):
    states = predict_model_state_bytes(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset)))
    assert states["per_rank"] == EXPECTED[preset]
    assert all(states[r] == EXPECTED[preset] for r in range(8))


def test_bf16_halves_only_the_compute_dtype_states():
    # zero_topo in bf16: weights 340 x 2 = 680; fp32 states unchanged (680, 340, 680); total 2380.
    states = predict_model_state_bytes(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), compute_bytes=2))
    assert states["per_rank"] == dict(weights=680, secondary=0, grad_accumulator=680, master=340,
                                      moments=680, total=2380)


def test_neox_20b_unit_sizes():
    # h = 6144, V = 50432: embedding 50432 x 6144 = 309,854,208; block 12h^2 + 13h = 452,984,832 +
    # 79,872 = 453,064,704; final 2h + Vh = 12,288 + 309,854,208 = 309,866,496.
    # Total 309,854,208 + 44 x 453,064,704 + 309,866,496 = 20,554,567,680 (NeoX's ~20.55B).
    units = neox_unit_sizes(44, 6144, 64, 50432, untied=True)
    assert len(units) == 46
    assert units[0] == 309_854_208 and units[1] == units[44] == 453_064_704 and units[45] == 309_866_496
    assert sum(units) == 20_554_567_680


def test_tied_and_custom_intermediate():
    # h = 8, I = 20, V = 16, 2 layers, tied: embedding 128; block 32 + (192 + 24) + (64 + 8) +
    # (160 + 20) + (160 + 8) = 668; final LayerNorm only: 16.
    assert neox_unit_sizes(2, 8, 2, 16, intermediate_size=20, untied=False) == [128, 668, 668, 16]


def _gpt_neox_class():
    try:
        from megatron.model import GPTNeoX
    except ImportError:
        pytest.skip("megatron.model.GPTNeoX is not written yet")
    return GPTNeoX


@pytest.mark.parametrize("untied", [True, False])
def test_unit_sizes_match_the_model(untied):
    gpt_neox = _gpt_neox_class()
    from megatron.config.schema import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      intermediate_size=96, no_weight_tying=untied, gpt_j_residual=True, padded_vocab_size=256)
    model = gpt_neox(cfg)
    predicted = neox_unit_sizes(2, 64, 4, 256, intermediate_size=96, untied=untied)
    assert sum(predicted) == sum(p.numel() for p in model.parameters())
    if untied:  # unit by unit (tied, the final unit shares the embedding matrix)
        units = [model.embed, *model.layers, model.final]
        assert predicted == [sum(p.numel() for p in unit.parameters()) for unit in units]


def test_the_device_peak_leaves_out_the_host_terms():
    from megatron.analytic.memory_model import device_peak_bytes
    peaks = {"build": {"states": 10, "unit being built (host)": 7, "unit being built (device)": 3, "total": 20},
             "step": {"states": 10, "activations": 5, "total": 15},
             "save": {"states": 10, "checkpoint pieces": 9, "total": 19},
             "load": {"states": 10, "mapped pages": 4, "unit being loaded": 2, "total": 16}}
    # device: build 13, step 15, save 10, load 12
    assert device_peak_bytes(peaks) == 15
