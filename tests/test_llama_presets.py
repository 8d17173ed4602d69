"""The Llama-shaped block (RMSNorm, SwiGLU, grouped-query attention, no biases, sequential residual;
and Mistral's sliding window) under every sharding preset on 8 simulated ranks (2x2x2), in ONE
launch: each preset against the single-process reference, INT8 and INT4 collectives close to it,
the byte ledger == the comm model and the model states == the memory model, and the sharded state's
round trip, resume and load into another layout; and the options beyond INT4 (Hadamard gradient
rotation, INT4 weight deltas with and without full refreshes) within test_beyond_int4.py's bounds.
The engine shards flat units and never looks inside a block; these prove it, with the same harnesses
as the NeoX-shaped model's tests (test_engine_dist.py, test_ledger_equals_model.py, test_beyond_int4.py)."""
from __future__ import annotations

import pytest
import torch

import test_beyond_int4 as beyond
import test_engine_dist as dist
import test_ledger_equals_model as ledger
from dist_harness import run_ranks
from megatron.analytic.comm_model import CommSpec, predict_ledger, predict_ledger_per_rank
from megatron.analytic.memory_model import predict_model_state_bytes
from megatron.model import unit_parameter_counts
from megatron.topology.layout import ShardLayout
from test_engine import VOCAB, build_model, max_param_diff, reference_run, tiny_cfg

# test_engine's tiny model (h = 16) reshaped: 4 heads of 4, 2 K/V heads; SwiGLU inner 12 (= 36 / 3).
LLAMA = dict(num_attention_heads=4, num_kv_heads=2, norm="rmsnorm", rms_norm_epsilon=1e-5, activation="swiglu",
             intermediate_size=36, use_bias_in_attn_linear=False, use_bias_in_mlp=False, rotary_pct=1.0,
             gpt_j_residual=False)
MISTRAL = dict(LLAMA, num_kv_heads=1, sliding_window_width=3)  # multi-query, a window shorter than SEQ 8
# test_ledger_equals_model's model (h = 12, 2 heads) reshaped: multi-query; SwiGLU inner 11 (33 -> 22 rows).
LEDGER_LLAMA = dict(num_kv_heads=1, norm="rmsnorm", activation="swiglu", use_bias_in_attn_linear=False,
                    use_bias_in_mlp=False, rotary_pct=1.0, gpt_j_residual=False)

PRESETS = ["stage0", "stage1", "stage2", "stage3", "hsdp", "zeropp", "zero_topo"]
INT8 = (8, 8, 8, 8, 8, False)   # every hop INT8 (weights, in-node and cross gradients, refresh), block 8
INT4 = (8, 4, 4, 8, 8, True)    # INT8 weights, INT4 gradients with error feedback
RUNS = ([{"name": p, "preset": p, "model": LLAMA} for p in PRESETS]
        + [{"name": "explicit_2_4_8", "factors": [2, 4, 8], "model": LLAMA},
           {"name": "zero_topo_recompute", "preset": "zero_topo", "checkpoint_activations": True, "model": LLAMA},
           {"name": "mistral_stage3", "preset": "stage3", "model": MISTRAL},
           {"name": "mistral_zero_topo", "preset": "zero_topo", "model": MISTRAL},
           {"name": "int8_zero_topo", "preset": "zero_topo", "quant": INT8, "model": LLAMA},
           {"name": "int4_zero_topo", "preset": "zero_topo", "quant": INT4, "model": LLAMA},
           {"name": "int4_zeropp", "preset": "zeropp", "quant": INT4, "model": LLAMA}])
EXACT = [r["name"] for r in RUNS if "quant" not in r]
LEDGER_CASES = [dict(ledger._case(f"{p}-A2", preset=p, accum=2), model=LEDGER_LLAMA) for p in PRESETS] + [
    dict(ledger._case("zero_topo-A1-ckpt", preset="zero_topo", checkpoint=True), model=LEDGER_LLAMA),
    dict(ledger._case("q-zero_topo-ef-A2", preset="zero_topo", accum=2, quant=ledger.ALL_Q_EF), model=LEDGER_LLAMA),
    dict(ledger._case("q-zeropp-A1", preset="zeropp", quant=ledger.ALL_Q), model=LEDGER_LLAMA)]
# test_beyond_int4.py's runs (preset, QuantSpec) of the options beyond INT4, here on the Llama block.
BEYOND = ["int4_rotation", "zeropp_8_4_rotation", "delta4", "delta4_full3"]
TIERS = (2, 2, 2)


def _worker(rank: int, world_size: int, layout: list[int]) -> dict:
    out = {"runs": dist._runs_worker(rank, world_size, layout, RUNS, dist.STEPS, dist.ACCUM)}
    groups: dict = {}
    out["ledger"] = {c["name"]: ledger._run_case(rank, layout, c, groups) for c in LEDGER_CASES}
    out["state"] = dist._state_worker(rank, world_size, layout, "zero_topo", LLAMA)
    out["resume"] = _resume(rank, world_size, layout)
    out["beyond"] = {name: _beyond_run(rank, layout, name) for name in BEYOND}
    return out


def _beyond_run(rank: int, layout: list[int], name: str) -> dict:
    """test_beyond_int4's steps (one micro-batch each) of one of its runs, and the final parameters."""
    preset, quant = beyond.RUNS[name]
    engine = beyond._engine(rank, layout, ShardLayout.resolve(tuple(layout), preset=preset), quant, LLAMA)
    steps = [beyond._step(engine, rank, step) for step in range(beyond.STEPS)]
    params = engine.full_state_dict()
    return {"steps": steps, "params": params if rank == 0 else None}


def _resume(rank: int, world_size: int, layout: list[int]) -> float:
    """Save after step 1 (zero_topo), load into a fresh engine of another layout (zeropp), train step 2
    there: the parameters equal those of the run that never stopped."""
    from megatron.checkpointing.param_slices import assemble
    engine, comm = dist._make_engine(rank, layout, {"preset": "zero_topo", "model": LLAMA}, 1)
    dist._train(engine, comm, rank, world_size, 1, 1)
    states = [None] * world_size
    torch.distributed.all_gather_object(states, engine.checkpoint_state())
    dist._train(engine, comm, rank, world_size, 2, 1)  # steps 0 and 1 again from here = steps 1, 2 overall
    resumed, resumed_comm = dist._make_engine(rank, layout, {"preset": "zeropp", "model": LLAMA}, 1)
    resumed.load_full_state(assemble(states))
    dist._train(resumed, resumed_comm, rank, world_size, 2, 1)
    return max_param_diff(engine.full_state_dict(), resumed.full_state_dict())


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return run_ranks("test_llama_presets:_worker", 8, tmp_path_factory.mktemp("llama8"), layout=[2, 2, 2])


@pytest.fixture(scope="module")
def references():
    return {"llama": reference_run(8, dist.STEPS, dist.ACCUM, **LLAMA),
            "mistral": reference_run(8, dist.STEPS, dist.ACCUM, **MISTRAL),
            "beyond": reference_run(8, beyond.STEPS, 1, **LLAMA)}


@pytest.mark.parametrize("name", EXACT)
def test_every_preset_matches_the_single_process(launch, references, name):
    ref = references["mistral" if name.startswith("mistral") else "llama"]
    for rank_result in launch:
        run = rank_result["runs"][name]
        assert run["losses"] == pytest.approx(ref["losses"], abs=dist.TOL)
        assert run["norms"] == pytest.approx(ref["norms"], rel=dist.TOL)
    assert max_param_diff(launch[0]["runs"][name]["params"], ref["params"]) < dist.TOL


def _update(params: dict, start: dict) -> torch.Tensor:
    return torch.cat([(params[n] - start[n]).flatten() for n in sorted(start)])


@pytest.mark.parametrize("name", [r["name"] for r in RUNS if "quant" in r])
def test_int8_and_int4_stay_close_to_the_single_process(launch, references, name):
    """Quantized hops change the numbers, by little: losses within 0.5% of the reference's, and the
    three steps' parameter update points the reference's way (cosine > 0.9; Adam's normalised steps
    make a bound on the difference alone weak) without being equal to it (the hops ran)."""
    ref = references["llama"]
    run = launch[0]["runs"][name]
    assert run["losses"] == pytest.approx(ref["losses"], rel=5e-3)
    start = {n: p.detach().float() for n, p in build_model(**LLAMA).named_parameters()}
    ours, theirs = _update(run["params"], start), _update(ref["params"], start)
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
    assert 0.9 < cosine < 1 - 1e-6, cosine


@pytest.mark.parametrize("case", LEDGER_CASES, ids=lambda c: c["name"])
def test_ledger_and_memory_equal_the_models(launch, case):
    runs = [r["ledger"][case["name"]] for r in launch]
    spec = ledger.spec_for("eight", case, 0)
    totals = runs[0]["windows"][0]["totals"]
    assert ledger.nonzero(totals) == predict_ledger(spec)
    per_rank = predict_ledger_per_rank(spec)
    predicted = predict_model_state_bytes(spec)
    for rank, run in enumerate(runs):
        assert ledger.nonzero(run["windows"][0]["own"]) == per_rank[rank]
        assert ledger._as_model_categories(run["memory"]["before_step"]) == predicted[rank]


def test_sharded_state_round_trip_resume_and_other_layout(launch):
    for rank_result in launch:
        state = rank_result["state"]
        assert state["reloaded_equal"] and state["cross_layout_diff"] < 1e-6
        assert state["loss_a"] == pytest.approx(state["loss_b"], abs=1e-6)
        assert rank_result["resume"] < 1e-6


@pytest.mark.parametrize("name", BEYOND)
def test_beyond_int4_stays_close_to_the_single_process(launch, references, name):
    """test_beyond_int4's bound (losses within 2% of the fp32 reference's) and this file's (the
    update points the reference's way, cosine > 0.9). That the hops ran is the ledger's proof below:
    the weight deltas alone leave an update too near the reference's for a cosine to tell."""
    ref = references["beyond"]
    run = launch[0]["beyond"][name]
    assert [record["loss"] for record in run["steps"]] == pytest.approx(ref["losses"], rel=0.02)
    start = {n: p.detach().float() for n, p in build_model(**LLAMA).named_parameters()}
    cosine = torch.nn.functional.cosine_similarity(_update(run["params"], start), _update(ref["params"], start), dim=0)
    assert cosine.item() > 0.9, cosine.item()


def _beyond_spec(name: str, full_refresh: bool) -> CommSpec:
    preset, quant = beyond.RUNS[name]
    return CommSpec(unit_parameter_counts(tiny_cfg(**LLAMA), VOCAB), ShardLayout.resolve(TIERS, preset=preset),
                    quant=quant, full_refresh=full_refresh)


@pytest.mark.parametrize("name", BEYOND)
def test_beyond_int4_ledger_equals_the_model_every_step(launch, name):
    for step, record in enumerate(launch[0]["beyond"][name]["steps"]):
        full = name == "delta4_full3" and (step + 1) % 3 == 0
        assert beyond._nonzero(record["ledger"]) == predict_ledger(_beyond_spec(name, full)), (name, step)


@pytest.mark.parametrize("name", ["delta4", "delta4_full3"])
def test_weight_deltas_agree_across_the_cross_group_and_stay_within_half_a_step(launch, name):
    """test_beyond_int4's bounds: every member of a cross group holds the same weights bit for bit;
    each stays within half a quantization step (1/14 of the unit's largest change) of its master,
    and a full refresh (every 3rd step) gives the master's values exactly."""
    layout = ShardLayout.resolve(TIERS, preset="zero_topo")
    assert all(len(layout.group("cross", rank)) == 2 for rank in range(len(launch)))  # pairs: a real check
    for step in range(beyond.STEPS):
        for rank, result in enumerate(launch):
            mine = result["beyond"][name]["steps"][step]["shards"]
            for peer in layout.group("cross", rank):
                theirs = launch[peer]["beyond"][name]["steps"][step]["shards"]
                assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), (name, step, rank, peer)
            record = result["beyond"][name]["steps"][step]
            full = name == "delta4_full3" and (step + 1) % 3 == 0
            for change, off in zip(record["changes"], record["off"]):
                assert off == 0.0 if full else off <= change / 14 * (1 + 1e-6) + 1e-7, (name, step, off, change)
