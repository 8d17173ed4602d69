"""The communication and memory model with quantized collectives (docs/engine.md, "Quantized
collectives"), against hand-computed tables.

Common setting: units of 100, 240, 240, 96 elements on 2 nodes x 2 GPUs x 2 GCDs (N = 8, R = 4), block
b = 4. With any phase quantized the padding quantum is q = N x b = 32: S = 128, 256, 256, 96 (sum 736).
With b = 4 a packed message of n elements is n x bits/8 + 4n/4 bytes:
    INT8: n + n = 2n bytes;  INT4: n/2 + n = 1.5n bytes.
Ranks r -> (node r//4, gpu (r//2)%2, gcd r%2). Every number below is written out by hand; none is
computed by the model. The last unit (96) stays gathered from its forward to its backward: backward
gathers cover units 0-2 only (S = 640; two-tier zeropp: 592).
"""
from fractions import Fraction
import importlib.util
from pathlib import Path

import pytest

from megatron.topology.layout import ShardLayout
from megatron.analytic.comm_model import (
    CommModelError, CommSpec, bytes_by_tier, packed_message_bytes, padded_unit_numels, predict_ledger,
    predict_ledger_per_rank, transformer_block_units)
from megatron.config.quant_spec import QuantSpec, QuantSpecError
from megatron.topology import Topology
from megatron.analytic.hardware import Hardware
from megatron.analytic.time_model import StepWork, footprint, step_time
from megatron.analytic.memory_model import neox_unit_sizes, predict_model_state_bytes

UNITS = (100, 240, 240, 96)
LAYOUT = (2, 2, 2)
ALL_QUANTIZED = QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, cross_node_grad_bits=4, refresh_bits=8,
                          block_size=4, error_feedback=True)
# Control collectives, N = 8 (as in test_comm_model.py): 616 bytes per rank on the world ring.
CONTROL = {("control", "intra_gpu"): 2464, ("control", "intra_node"): 1232, ("control", "inter_node"): 1232}


def test_packed_message_bytes():
    assert packed_message_bytes(8, 8, 4) == 16            # 8 codes + 2 scales x 4
    assert packed_message_bytes(8, 4, 4) == 12            # 4 bytes of nibbles + 2 scales x 4
    assert packed_message_bytes(4096, 4, 2048) == 2056    # 2048 + 2 x 4
    with pytest.raises(CommModelError, match="whole blocks"):
        packed_message_bytes(6, 8, 4)


def test_padding_is_n_times_the_block_when_any_phase_is_quantized():
    assert padded_unit_numels(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), quant=ALL_QUANTIZED)) == (128, 256, 256, 96)
    only_refresh = QuantSpec(refresh_bits=8, block_size=4)
    assert padded_unit_numels(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="stage2"), quant=only_refresh)) == (128, 256, 256, 96)
    # feedback alone quantizes nothing: q stays N = 8
    feedback_only = QuantSpec(block_size=4, error_feedback=True)
    assert padded_unit_numels(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), quant=feedback_only)) == (104, 240, 240, 96)


def test_zero_topo_all_quantized():
    # (w, g, os) = (2, 4, 8), fp32, A = 2; INT8 weights, INT4 grads, INT4 cross, INT8 refresh.
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), micro_batches=2, compute_bytes=4, quant=ALL_QUANTIZED)
    assert predict_ledger(spec) == {
        # weight pairs (intra_gpu): allgather of 2 INT8 messages of S/2 -> B = 2 x 2 x S/2 = 2S bytes;
        #   each member sends 1/2 x B = S = 736 per gather; x A = 2 -> 1472 per rank, x 8 ranks.
        #   backward: units 0-2, 640 per gather -> 1280 per rank, x 8 = 10240.
        ("fwd_gather", "intra_gpu"): 11776, ("bwd_gather", "intra_gpu"): 10240,
        # grad hop 1, weight pair all-to-all: input S, B = 2 x 1.5 x S/2 = 1.5S; each member sends B/2 =
        #   0.75 x 736 = 552 to its partner per micro-batch -> 1104 per rank -> x 8 = 8832 intra_gpu.
        # grad hop 2, stride pair {0,2} (intra_node): input S/2, B = 2 x 1.5 x S/4 = 0.75S; sends B/2 =
        #   0.375 x 736 = 276 per micro-batch -> 552 per rank -> x 8 = 4416.
        ("grad_reduce", "intra_gpu"): 8832, ("grad_reduce", "intra_node"): 4416,
        # cross pair {r, r+4} (inter_node), once: input S/4, B = 2 x 1.5 x S/8 = 0.375S; sends B/2 =
        #   0.1875 x 736 = 138 per rank -> 1104.
        ("cross_grad_reduce", "inter_node"): 1104,
        # refresh cross hop INT8: B = 2 x 2 x S/8 = S/2 = 368; sends 1/2 -> 184 per rank -> 1472.
        # refresh stride hop in fp32: allgather of S/2 x 4 = 2S bytes; sends S = 736 per rank -> 5888.
        ("refresh", "inter_node"): 1472, ("refresh", "intra_node"): 5888,
        **CONTROL}


def test_zero_topo_all_quantized_memory():
    # weights S/2 x 4 = 368 x 4 = 1472; grad accumulator S/4 x 4 = 184 x 4 = 736; master S/8 x 4 =
    # 92 x 4 = 368; moments 736; error feedback, fp32, on the cross-node hop only, its input S/4 x 4 =
    # 736 (the weight and stride hops inside the node keep none). Total 1472 + 736 + 368 + 736 + 736 = 4048.
    expected = dict(weights=1472, secondary=0, grad_accumulator=736, master=368, moments=736,
                    error_feedback=736, total=4048)
    states = predict_model_state_bytes(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), quant=ALL_QUANTIZED))
    assert states["per_rank"] == expected
    assert all(states[r] == expected for r in range(8))


def test_zeropp_qwz_qgz():
    # zeropp, fp32, A = 2, INT8 weights (qwZ), INT4 two-hop gradients (qgZ), b = 4, R = 4.
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zeropp"), micro_batches=2, compute_bytes=4, quant=ALL_QUANTIZED)
    assert predict_ledger(spec) == {
        # first forward gather over the world: 8 INT8 messages of S/8 -> B = 2S; 7/8 x 2S = 1288 per
        #   rank; world ring (4 gpu, 2 node, 2 inter hops): 5152 / 2576 / 2576.
        # second micro-batch's forward from the secondary copies in the node {0..3}: 4 messages of S/4
        #   -> B = 2S; 3/4 x 2S = 1104 per rank; node ring 0-1 gpu, 1-2 node, 2-3 gpu, 3-0 node, so 4
        #   gpu and 4 node senders: 4416 each. fwd: gpu 5152 + 4416, node 2576 + 4416, inter 2576.
        ("fwd_gather", "intra_gpu"): 9568, ("fwd_gather", "intra_node"): 6992, ("fwd_gather", "inter_node"): 2576,
        # backward: two node gathers of units 0-2, 3/4 x 2 x 640 = 960 per rank -> 1920 x 4 senders per tier.
        ("bwd_gather", "intra_gpu"): 7680, ("bwd_gather", "intra_node"): 7680,
        # qgZ hop 1, node all-to-all: input S, B = 4 x 1.5 x S/4 = 1.5S; B/4 = 276 to each of 3 peers
        #   (rank 0: 1 intra_gpu, 2 and 3 intra_node) -> per micro-batch 276 gpu + 552 node per rank;
        #   x 2 x 8: gpu 4416, node 8832.
        # hop 2, same-local pairs {l, l+4} (inter_node): input S/4, B = 2 x 1.5 x S/8 = 276; B/2 = 138
        #   per micro-batch -> 276 per rank -> 2208.
        ("grad_reduce", "intra_gpu"): 4416, ("grad_reduce", "intra_node"): 8832, ("grad_reduce", "inter_node"): 2208,
        **CONTROL}
    per_rank = predict_ledger_per_rank(spec)
    assert per_rank[0][("grad_reduce", "intra_gpu")] == 552 and per_rank[0][("grad_reduce", "intra_node")] == 1104
    assert per_rank[5][("grad_reduce", "inter_node")] == 276


def test_zeropp_qwz_qgz_memory():
    # weights S/8 x 4 = 92 x 4 = 368; secondary = INT8 message of S/4: 2 x 184 = 368; grad accumulator,
    # master 368 each; moments 736; error feedback on the cross-node hop 2 only, its input S/4 x 4 = 736
    # (hop 1 inside the node keeps none). Total 4 x 368 + 736 + 736 = 2944.
    states = predict_model_state_bytes(CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zeropp"), quant=ALL_QUANTIZED))
    assert states["per_rank"] == dict(weights=368, secondary=368, grad_accumulator=368, master=368,
                                      moments=736, error_feedback=736, total=2944)


def test_stage3_int8_weights_only():
    # (8, 8, 8), fp32, A = 2; only weight gathers quantized (b = 4 still pads to q = 32).
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="stage3"), micro_batches=2, quant=QuantSpec(weight_gather_bits=8, block_size=4))
    assert predict_ledger(spec) == {
        # world gathers of 8 INT8 messages of S/8: B = 2S, 7/8 x 2S = 1288 per rank, x 2 = 2576;
        #   world ring: gpu 4 x 2576, node 2 x, inter 2 x.
        ("fwd_gather", "intra_gpu"): 10304, ("fwd_gather", "intra_node"): 5152, ("fwd_gather", "inter_node"): 5152,
        # backward, units 0-2: 7/8 x 2 x 640 = 1120 per rank, x 2 = 2240 -> 8960 / 4480 / 4480.
        ("bwd_gather", "intra_gpu"): 8960, ("bwd_gather", "intra_node"): 4480, ("bwd_gather", "inter_node"): 4480,
        # gradient reduce-scatter over the world in fp32: 7/8 x 4S = 2576 per micro-batch, x 2 = 5152.
        ("grad_reduce", "intra_gpu"): 20608, ("grad_reduce", "intra_node"): 10304, ("grad_reduce", "inter_node"): 10304,
        **CONTROL}
    # no error-feedback category without feedback; S/8 = 92 -> 368 per fp32 state
    assert predict_model_state_bytes(spec)["per_rank"] == dict(
        weights=368, secondary=0, grad_accumulator=368, master=368, moments=736, total=1840)


def test_stage1_quantized_cross_hop_is_a_world_all_to_all():
    # (1, 1, 8): weight and stride groups have one rank (no hop, no residual); the cross group is the
    # world. from_settings(quantized_gradients) -> grad 4, cross 4. fp32, A = 2 (no micro-step traffic).
    quant = QuantSpec.from_settings(quantized_gradients=True, block_size=4, error_feedback=True)
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="stage1"), micro_batches=2, quant=quant)
    assert predict_ledger(spec) == {
        # input S, B = 8 x 1.5 x S/8 = 1.5S = 1104; B/8 = 138 to each of 7 peers: per rank 1 intra_gpu,
        #   2 intra_node, 4 inter_node peers -> 138 / 276 / 552 per rank, x 8.
        ("cross_grad_reduce", "intra_gpu"): 1104, ("cross_grad_reduce", "intra_node"): 2208,
        ("cross_grad_reduce", "inter_node"): 4416,
        # refresh unquantized: world allgather of S fp32, 7/8 x 4S = 2576 per rank on the world ring.
        ("refresh", "intra_gpu"): 10304, ("refresh", "intra_node"): 5152, ("refresh", "inter_node"): 5152,
        **CONTROL}
    # weights S x 4 = 2944, accumulator S x 4 = 2944, master 368, moments 736, one residual (cross hop,
    # input S/g = S): 2944. Total 2944 x 3 + 368 + 736 = 9936.
    assert predict_model_state_bytes(spec)["per_rank"] == dict(
        weights=2944, secondary=0, grad_accumulator=2944, master=368, moments=736, error_feedback=2944,
        total=9936)


def test_zero_topo_bf16_cross_and_refresh_only():
    # The paper's setting: INT4 cross-node gradients, INT8 refresh, everything else bf16 (c = 2), A = 1.
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), compute_bytes=2,
                    quant=QuantSpec(cross_node_grad_bits=4, refresh_bits=8, block_size=4))
    assert predict_ledger(spec) == {
        # weight pairs, bf16: buffer 2S bytes, 1/2 -> S = 736 per rank, x 8 ranks, per phase.
        #   backward: units 0-2, 640 per rank -> 5120.
        ("fwd_gather", "intra_gpu"): 5888, ("bwd_gather", "intra_gpu"): 5120, ("grad_reduce", "intra_gpu"): 5888,
        # stride reduce-scatter of S/2 bf16 = S bytes -> 368 per rank -> 2944.
        ("grad_reduce", "intra_node"): 2944,
        # quantized step-boundary hops as in the all-quantized case: 138 and 184 per rank.
        ("cross_grad_reduce", "inter_node"): 1104, ("refresh", "inter_node"): 1472,
        # refresh stride hop in bf16: allgather of S/2 x 2 = S bytes -> 368 per rank -> 2944.
        ("refresh", "intra_node"): 2944,
        **CONTROL}
    # weights S/2 x 2 = 736, accumulator 736, master 368, moments 736: 2576.
    assert predict_model_state_bytes(spec)["per_rank"] == dict(
        weights=736, secondary=0, grad_accumulator=736, master=368, moments=736, total=2576)


def test_two_tier_zeropp_qwz_qgz():
    # 2 nodes x 2 ranks (N = 4, R = 2), q = 16: S = 112, 240, 240, 96 (688). fp32, A = 1.
    spec = CommSpec(UNITS, ShardLayout.resolve((2, 2), preset="zeropp"), quant=ALL_QUANTIZED)
    assert padded_unit_numels(spec) == (112, 240, 240, 96)
    assert predict_ledger(spec) == {
        # world gather, 4 INT8 messages of S/4: B = 2S; 3/4 x 2S = 1032 per rank; world ring 0-1 node,
        #   1-2 inter, 2-3 node, 3-0 inter -> 2064 each.
        ("fwd_gather", "intra_node"): 2064, ("fwd_gather", "inter_node"): 2064,
        # backward from the secondary copies, node pairs: B = 2 x 2 x S/2 = 2S; 1/2 -> S per rank, units
        #   0-2: 592 per rank -> 2368.
        ("bwd_gather", "intra_node"): 2368,
        # hop 1, node pairs: B = 2 x 1.5 x S/2 = 1.5S, B/2 = 516 per rank -> 2064; hop 2, pairs {0,2}
        #   {1,3}: input S/2, B = 2 x 1.5 x S/4 = 516, B/2 = 258 per rank -> 1032.
        ("grad_reduce", "intra_node"): 2064, ("grad_reduce", "inter_node"): 1032,
        # control, N = 4: 456 per rank, 2 senders per tier (test_comm_model.py).
        ("control", "intra_node"): 912, ("control", "inter_node"): 912}
    # weights S/4 x 4 = 688; secondary INT8 message of S/2 = 2 x 344 = 688; accumulator, master 688;
    # moments 1376; one residual, hop 2 (across nodes): S/2 x 4 = 1376. Total 4 x 688 + 1376 + 1376 = 5504.
    assert predict_model_state_bytes(spec)["per_rank"] == dict(
        weights=688, secondary=688, grad_accumulator=688, master=688, moments=1376, error_feedback=1376,
        total=5504)


# -- settings and refusals ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, bits", [
    (dict(), (0, 0, 0, 0)),
    (dict(quantized_weights=True), (8, 0, 0, 8)),
    (dict(quantized_gradients=True), (0, 4, 4, 0)),
    (dict(quantized_refresh=True), (0, 0, 0, 8)),
    (dict(quantized_weights=True, quantized_gradients=True), (8, 4, 4, 8)),
    (dict(quantized_gradients=True, cross_node_grad_bits=8), (0, 4, 8, 0)),
    (dict(grad_reduce_bits=8), (0, 8, 8, 0)),
    (dict(quantized_weights=True, weight_gather_bits=0), (0, 0, 0, 8)),
    (dict(quantized_weights=True, refresh_bits=0, cross_node_grad_bits=4), (8, 0, 4, 0)),
])
def test_from_settings_applies_the_documented_defaults(kwargs, bits):
    quant = QuantSpec.from_settings(block_size=64, error_feedback=True, **kwargs)
    assert (quant.weight_gather_bits, quant.grad_reduce_bits, quant.cross_node_grad_bits, quant.refresh_bits) == bits
    assert quant.block_size == 64 and quant.error_feedback


@pytest.mark.parametrize("fields, message", [
    (dict(refresh_bits=16), "refresh_bits"),
    (dict(grad_reduce_bits=2), "grad_reduce_bits"),
    (dict(weight_gather_bits=8, block_size=0), "block_size"),
    (dict(grad_reduce_bits=4, block_size=5), "even"),
    (dict(weight_gather_bits=4), "weight_gather_bits"),  # INT4 weights: refused by the one spec
])
def test_bad_quant_settings_are_refused(fields, message):
    with pytest.raises(QuantSpecError, match=message):
        QuantSpec(**fields)


def test_a_quant_that_is_not_a_spec_is_refused():
    with pytest.raises(CommModelError, match="QuantSpec"):
        CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), quant={"refresh": 8})


def test_odd_block_is_fine_at_eight_bits():
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset="zero_topo"), quant=QuantSpec(weight_gather_bits=8, block_size=3))
    assert padded_unit_numels(spec) == (120, 240, 240, 96)  # q = 24


# -- properties ---------------------------------------------------------------------------------

def phase_totals(ledger):
    out: dict = {}
    for (phase, _tier), nbytes in ledger.items():
        out[phase] = out.get(phase, 0) + nbytes
    return out


@pytest.mark.parametrize("layout", [(2, 2, 2), (3, 2, 2)])
def test_quantized_phase_bytes_scale_by_the_message_ratio(layout):
    # Units already whole multiples of N x b pad identically with and without quantization; then each
    # quantized phase moves (bits/8 + 4/b) / c of its unquantized bytes (an all-to-all sends
    # (k-1) x B/k per member, what a ring reduce-scatter sends), and the others are unchanged.
    n, block = 1, 8
    for size in layout:
        n *= size
    units = tuple(n * block * m for m in (3, 5, 5, 2))
    quant = QuantSpec(weight_gather_bits=8, grad_reduce_bits=4, cross_node_grad_bits=4, refresh_bits=8,
                      block_size=block)
    for c in (2, 4):
        base = CommSpec(units, ShardLayout.resolve(layout, preset="zero_topo"), micro_batches=3, compute_bytes=c,
                        checkpointed_units=transformer_block_units(4), eval_forward_passes=1)
        plain = phase_totals(predict_ledger(base))
        quantized = phase_totals(predict_ledger(CommSpec(
            units, ShardLayout.resolve(layout, preset="zero_topo"), micro_batches=3, compute_bytes=c,
            checkpointed_units=transformer_block_units(4), eval_forward_passes=1, quant=quant)))
        int8, int4 = Fraction(8, 8) + Fraction(4, block), Fraction(4, 8) + Fraction(4, block)
        for phase in ("fwd_gather", "recompute_gather", "bwd_gather", "eval_gather"):
            assert quantized[phase] == plain[phase] * int8 / c, phase
        assert quantized["grad_reduce"] == plain["grad_reduce"] * int4 / c
        assert quantized["cross_grad_reduce"] == plain["cross_grad_reduce"] * int4 / c
        assert quantized["control"] == plain["control"]
        # refresh: the cross hop is INT8, the stride hop stays in dtype c
        stride_hop = predict_ledger(base)[("refresh", "intra_node")]
        assert quantized["refresh"] == stride_hop + (plain["refresh"] - stride_hop) * int8 / c


@pytest.mark.parametrize("preset", ["zero_topo", "zeropp", "stage3", "hsdp", "stage2"])
def test_error_feedback_changes_memory_not_traffic(preset):
    on = ALL_QUANTIZED
    off = QuantSpec(8, 4, 4, 8, block_size=4, error_feedback=False)
    spec_on = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset), micro_batches=2, quant=on)
    spec_off = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset), micro_batches=2, quant=off)
    assert predict_ledger(spec_on) == predict_ledger(spec_off)
    with_feedback = predict_model_state_bytes(spec_on)["per_rank"]
    without = predict_model_state_bytes(spec_off)["per_rank"]
    assert "error_feedback" not in without
    if preset in ("zero_topo", "zeropp"):  # a quantized hop across nodes after the node's reduction
        assert with_feedback["error_feedback"] > 0
        assert with_feedback["total"] - with_feedback["error_feedback"] == without["total"]
    else:  # their quantized hops take the whole unit: a residual there would be a model copy
        assert with_feedback == without


@pytest.mark.parametrize("preset", ["zero_topo", "zeropp", "stage1", "hsdp"])
def test_per_rank_sums_to_total_with_all_to_alls(preset):
    spec = CommSpec(UNITS, ShardLayout.resolve(LAYOUT, preset=preset), micro_batches=3, compute_bytes=2, eval_forward_passes=1,
                    checkpointed_units=transformer_block_units(len(UNITS)), quant=ALL_QUANTIZED)
    total: dict = {}
    for entries in predict_ledger_per_rank(spec).values():
        for key, nbytes in entries.items():
            total[key] = total.get(key, 0) + nbytes
    assert total == predict_ledger(spec)


def test_all_to_all_link_load():
    # World all-to-all on 2 x 2 x 2: each of a node's 4 ranks takes 1/8 of B from each of the other
    # node's 4 ranks through the node's NICs (4 x 4 / 8 = 2.0); in the node a rank takes 1/8 from
    # each of the other GPU's 2 ranks (2 / 8) and from its partner (1 / 8) over its own links.
    assert footprint([list(range(8))], LAYOUT, "all_to_all").domain_load == {
        "inter_node": 2.0, "intra_node": 0.25, "intra_gpu": 0.125}


def test_quantized_zero_topo_20b_on_48_nodes():
    # docs/communication.md: INT4 cross-node gradients and INT8 refresh take ZeRO-topo's inter-node bytes from
    # ~0.49 to ~0.18 x params per GCD per step (47/48 x 1/8 x (0.5 + 1.0 + 8/2048) = 0.1844).
    units = neox_unit_sizes(44, 6144, 64, 50432)
    params, n = sum(units), 384
    quant = QuantSpec.from_settings(quantized_weights=True, quantized_gradients=True)
    for a in (1, 8):
        plain = CommSpec(units, ShardLayout.resolve((48, 4, 2), preset="zero_topo"), micro_batches=a, compute_bytes=2)
        quantized = CommSpec(units, ShardLayout.resolve((48, 4, 2), preset="zero_topo"), micro_batches=a, compute_bytes=2, quant=quant)
        ratio = bytes_by_tier(predict_ledger(quantized))["inter_node"] / n / params
        assert 0.183 < ratio < 0.186
        hw = Hardware.from_topology(Topology.simulated((48, 4, 2)), device="mi250x_gcd")
        work = StepWork(2048, tuple(2.0 * p for p in units))
        assert sum(step_time(quantized, hw, work).inter_node_comm_s.values()) < \
            sum(step_time(plain, hw, work).inter_node_comm_s.values())


def test_bench_quantized_variants(capsys):
    path = Path(__file__).resolve().parents[1] / "bench" / "comm_volume.py"
    spec = importlib.util.spec_from_file_location("comm_volume", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--layout", "2", "2", "2",
                "--micro-batches", "1", "4", "--presets", "zero_topo", "zero_topo-q", "zeropp", "zeropp-q",
                "--block-size", "64"])
    summary = capsys.readouterr().out.split("summary")[1].splitlines()[2:]
    rows = {(cols[0], cols[1]): cols for cols in (line.split() for line in summary if line.strip())}
    assert set(rows) == {(p, a) for p in ("zero_topo", "zero_topo-q", "zeropp", "zeropp-q") for a in ("1", "4")}
    # column 3 = inter-node bytes / parameters: quantization cuts it, and zero_topo's stays flat in A
    for name in ("zero_topo", "zeropp"):
        assert float(rows[(name + "-q", "1")][3]) < float(rows[(name, "1")][3])
    assert rows[("zero_topo-q", "1")][3] == rows[("zero_topo-q", "4")][3]
