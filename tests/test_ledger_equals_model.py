"""Proofs 1 and 2 of the ZeRO-topo engine: the byte ledger equals the comm model, and the model states
the engine holds equal the memory model — exactly, in integers, entry by entry.

The engine (megatron/engine/zero_topo.py, comm.py, ledger.py) and the analytic model
(comm_model.py, memory_model.py) are two independent statements of docs/engine.md. Here the real
engine trains the real GPTNeoX on gloo ranks in the trainer's order, and the parent process compares
what it measured with ``predict_ledger`` / ``predict_ledger_per_rank`` / ``predict_model_state_bytes``:

- every preset (stage0..3, hsdp, zeropp, zero_topo) and explicit factors, on 2x2x2 (8 ranks) and
  2x2 (4 ranks), at gradient accumulation 1 and 2, with and without activation checkpointing;
- bf16 (compute_bytes 2), with and without fp32_allreduce (fp32 step-boundary hops, and fp32
  micro-step hops where their groups span nodes: stage 2/3, zeropp, factors (2, 8, 8));
- evaluation passes in a window: the trainer evaluates after a step's ledger sync, so the eval
  gathers and the eval-loss allreduce land in the *next* step's window;
- quantized collectives (zero_topo all-quantized, zeropp qwZ + qgZ, stage 3 INT8 weights), with and
  without error feedback, on a small block so padding to N x b and whole-block chunks are exercised;
- the paper's step-boundary hop (cross_node_reduction all_reduce): fp32, bf16, fp32 under bf16 on
  cross groups over both tiers, and configs/zero_topo_paper.yml's quantization.

Unit sizes for the model are the unpadded counts of ``megatron.model.unit_parameter_counts``; the
model is shaped so that no unit is a multiple of 8 (padding is exercised on every unit at N = 8).
All cases of a layout run in ONE launch (8 ranks cost ~12 s to start on 2 cores); each case builds a
fresh engine (process groups are reused per factor triple: they are immutable rank lists).
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.topology.names import MEMORY_CATEGORIES
from megatron.config.schema import ModelConfig
from megatron.engine import lm_loss
from megatron.model import GPTNeoX, unit_parameter_counts
from megatron.topology import ProcessGroups, Topology, validate_factors
from megatron.engine import Communicator, ZeroTopoEngine
from megatron.analytic.comm_model import (CommSpec, padded_unit_numels, predict_ledger, predict_ledger_per_rank, transformer_block_units)
from megatron.config.quant_spec import QuantSpec
from megatron.analytic.memory_model import predict_model_state_bytes
from test_engine import LR, OPT

# A model whose units are 420, 1509 and 444 elements: none a multiple of 8, the block none of 4.
VOCAB, SEQ, MICRO_BSZ, SEED = 35, 8, 2, 4321
MODEL_FIELDS = dict(num_layers=2, hidden_size=12, num_attention_heads=2, seq_length=SEQ, intermediate_size=33,
                    no_weight_tying=True)
LAYOUTS = {"eight": (2, 2, 2), "four": (2, 2)}


def model_config(checkpoint_activations: bool = False, **overrides) -> ModelConfig:
    """The test's model; ``overrides`` reshape its block (the Llama-shaped cases, test_llama_presets.py)."""
    return ModelConfig(**{**MODEL_FIELDS, **overrides}, checkpoint_activations=checkpoint_activations)


# ------------------------------------------------------------------------------------------ the cases

def _case(name: str, *, preset: str | None = None, factors: tuple | None = None, accum: int = 1,
          checkpoint: bool = False, precision: str = "fp32", fp32_allreduce: bool = False, eval_iters: int = 0,
          quant: tuple | None = None, cross_node_reduction: str = "reduce_scatter", reduce_dtype: str | None = None) -> dict:
    """``quant``: (weight, grad, cross, refresh bits, block, error feedback), or None for none;
    ``reduce_dtype``: communication_data_type (fp32, bf16, fp16), or None."""
    return dict(name=name, preset=preset, factors=factors, accum=accum, checkpoint=checkpoint, precision=precision,
                fp32_allreduce=fp32_allreduce, eval_iters=eval_iters, quant=quant,
                cross_node_reduction=cross_node_reduction, reduce_dtype=reduce_dtype)


def _cases(presets: list, factor_sets: list, extras: list) -> list[dict]:
    """Every sharding x accumulation {1, 2} x checkpointing {off, on}, plus the extra cases."""
    kinds = [(p, dict(preset=p)) for p in presets]
    kinds += [("f" + "-".join(map(str, f)), dict(factors=f)) for f in factor_sets]
    out = [_case(f"{label}-A{accum}{'-ckpt' if ckpt else ''}", accum=accum, checkpoint=ckpt, **kind)
           for label, kind in kinds for accum in (1, 2) for ckpt in (False, True)]
    return out + extras


PRESETS = ["stage0", "stage1", "stage2", "stage3", "hsdp", "zeropp", "zero_topo"]
# (weight, grad, cross, refresh bits, block, error feedback); block 8 keeps units several blocks long.
ALL_Q, ALL_Q_EF = (8, 4, 4, 8, 8, False), (8, 4, 4, 8, 8, True)
WEIGHTS_Q = (8, 0, 0, 0, 8, False)
PAPER_Q = (8, 4, 0, 8, 8, False)  # configs/zero_topo_paper.yml: INT8 weights and refresh, INT4 in-node hops
# cross_node_reduction all_reduce (the paper's step-boundary hop), on both layouts
ALL_REDUCE_CASES = [
    _case("ar-zero_topo-A2", preset="zero_topo", accum=2, cross_node_reduction="all_reduce"),
    _case("ar-zero_topo-bf16-A1", preset="zero_topo", precision="bfloat16", cross_node_reduction="all_reduce"),
    _case("ar-q-paper-A2-ckpt", preset="zero_topo", accum=2, checkpoint=True, quant=PAPER_Q,
          cross_node_reduction="all_reduce"),
]
QUANT_CASES = [
    _case("q-zero_topo-A1", preset="zero_topo", quant=ALL_Q),
    _case("q-zero_topo-ef-A2-ckpt", preset="zero_topo", accum=2, checkpoint=True, quant=ALL_Q_EF),
    _case("q-zeropp-A2", preset="zeropp", accum=2, quant=ALL_Q),
    _case("q-zeropp-ef-A1", preset="zeropp", quant=ALL_Q_EF),
    _case("q-stage3-w8-A1", preset="stage3", quant=WEIGHTS_Q),
    _case("q-stage3-w8-ef-bf16-A2", preset="stage3", accum=2, precision="bfloat16", quant=(8, 0, 0, 0, 8, True)),
    _case("q-zero_topo-ef-bf16-eval1-A2", preset="zero_topo", accum=2, precision="bfloat16", eval_iters=1,
          quant=ALL_Q_EF),
    # stage 1: the weight and stride groups have one rank, so the only quantized hop is the cross one
    _case("q-stage1-ef-A2", preset="stage1", accum=2, quant=ALL_Q_EF),
    _case("q-hsdp-ef-A1-ckpt", preset="hsdp", checkpoint=True, quant=ALL_Q_EF),
]
REDUCE_DTYPE_CASES = [  # communication_data_type: fp32 sums inside the node too under bf16 compute; bf16 across nodes
    _case("zero_topo-bf16-comm-fp32-A2", preset="zero_topo", accum=2, precision="bfloat16", reduce_dtype="fp32"),
    _case("stage3-fp32-comm-bf16-A1", preset="stage3", reduce_dtype="bf16"),
]
CASES = {
    "eight": _cases(PRESETS, [(2, 4, 8), (1, 2, 4)], [
        _case("zero_topo-bf16-A2-ckpt", preset="zero_topo", accum=2, checkpoint=True, precision="bfloat16"),
        _case("zero_topo-bf16-fp32ar-A2", preset="zero_topo", accum=2, precision="bfloat16", fp32_allreduce=True),
        _case("zeropp-bf16-A2-ckpt", preset="zeropp", accum=2, checkpoint=True, precision="bfloat16"),
        _case("hsdp-bf16-fp32ar-A1", preset="hsdp", precision="bfloat16", fp32_allreduce=True),
        # the weight hop stays in a node (bf16), the stride hop spans both (fp32)
        _case("f2-8-8-bf16-fp32ar-A2", factors=(2, 8, 8), accum=2, precision="bfloat16", fp32_allreduce=True),
        _case("zeropp-eval2-A2-ckpt", preset="zeropp", accum=2, checkpoint=True, eval_iters=2),
        _case("zero_topo-eval1-A1", preset="zero_topo", eval_iters=1),
        _case("stage3-eval1-A1-ckpt", preset="stage3", checkpoint=True, eval_iters=1),
        _case("stage0-eval1-A1", preset="stage0", eval_iters=1),
        _case("hsdp-bf16-eval2-A2", preset="hsdp", accum=2, precision="bfloat16", eval_iters=2),
        *QUANT_CASES,
        *ALL_REDUCE_CASES,
        # cross groups {0, 2, 4, 6} {1, 3, 5, 7}: a ring over both tiers, in fp32 under bf16 compute
        _case("ar-f1-2-8-bf16-fp32ar-A1", factors=(1, 2, 8), precision="bfloat16", fp32_allreduce=True,
              cross_node_reduction="all_reduce"),
        *REDUCE_DTYPE_CASES,
    ]),
    "four": _cases(PRESETS, [(1, 2, 4), (1, 2, 2)], [
        _case("zero_topo-bf16-A2-ckpt", preset="zero_topo", accum=2, checkpoint=True, precision="bfloat16"),
        _case("zeropp-bf16-fp32ar-A2", preset="zeropp", accum=2, precision="bfloat16", fp32_allreduce=True),
        _case("stage3-bf16-fp32ar-A2", preset="stage3", accum=2, precision="bfloat16", fp32_allreduce=True),
        _case("stage2-bf16-fp32ar-A1", preset="stage2", precision="bfloat16", fp32_allreduce=True),
        _case("zeropp-eval2-A2-ckpt", preset="zeropp", accum=2, checkpoint=True, eval_iters=2),
        _case("zero_topo-eval1-A2", preset="zero_topo", accum=2, eval_iters=1),
        _case("f1-2-2-eval2-A1", factors=(1, 2, 2), eval_iters=2),
        *REDUCE_DTYPE_CASES,
        *QUANT_CASES,
        *ALL_REDUCE_CASES,
    ]),
}


# ------------------------------------------------------------------------------------------ the worker

def make_batch(step: int, micro: int, rank: int, split: str = "train") -> dict:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank + (7 if split == "valid" else 0))
    tokens = torch.randint(0, VOCAB, (MICRO_BSZ, SEQ + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _train_step(engine: ZeroTopoEngine, rank: int, step: int, accum: int) -> dict:
    """megatron/training.py ``Trainer.train_step``: micro-batches, optimizer step, one allreduce of
    the step vector (loss sum, micro-batch count, stop flag).

    Returns the model states measured just before the optimizer step (zeropp's secondary copy is
    held then) and just after it."""
    local_loss_sum = sum(float(engine.forward_backward(make_batch(step, m, rank))) for m in range(accum))
    before_step = engine.model_state_bytes()
    engine.optimizer_step(LR)
    engine.all_reduce_sum([local_loss_sum, float(accum), 0.0], sync_ledger=True)
    return {"before_step": before_step, "after_step": engine.model_state_bytes()}


def _keep_own_counters(engine: ZeroTopoEngine) -> dict:
    """This rank's own counters at each sync (the step vector's bytes included), for the per-rank
    comparison: the engine resets its ledger once the step vector has carried them."""
    own: dict = {}
    reset = engine.ledger.reset

    def keep_then_reset() -> None:
        own["counters"] = engine.ledger.snapshot()
        reset()
    engine.ledger.reset = keep_then_reset
    return own


def _evaluate(engine: ZeroTopoEngine, rank: int, eval_iters: int) -> None:
    """``Trainer.evaluate``: one eval_loss per eval micro-batch, then one loss allreduce."""
    loss_sum = sum(float(engine.eval_loss(make_batch(i, 0, rank, "valid"))) for i in range(eval_iters))
    engine.all_reduce_sum([loss_sum, float(eval_iters)])


def _close_window(engine: ZeroTopoEngine, own: dict) -> dict:
    """``Trainer._comm_metrics``: the totals the step vector carried, and this rank's own counters."""
    return {"totals": engine.synced_ledger(), "own": own["counters"]}


def _run_case(rank: int, layout: list[int], case: dict, groups_by_factors: dict) -> dict:
    topology = Topology.simulated(layout)
    layout = (ShardLayout.from_topology(topology, validate_factors(topology.world_size, *case["factors"]))
              if case["factors"] else ShardLayout.from_topology(topology, preset=case["preset"]))
    if layout not in groups_by_factors:  # one set of torch groups per layout, made once per launch
        groups_by_factors[layout] = ProcessGroups(topology, layout, rank)
    groups = groups_by_factors[layout]
    torch.manual_seed(SEED)
    model = GPTNeoX(model_config(case["checkpoint"], **case.get("model", {})), VOCAB)
    quant = None
    if case["quant"]:
        weight, grad, cross, refresh, block, feedback = case["quant"]
        quant = QuantSpec(weight_gather_bits=weight, grad_reduce_bits=grad, cross_node_grad_bits=cross, refresh_bits=refresh, block_size=block,
                              error_feedback=feedback, impl="reference")
    engine = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision=case["precision"], accumulation_steps=case["accum"], fp32_allreduce=case["fp32_allreduce"], quant=quant, cross_node_reduction=case["cross_node_reduction"], reduce_dtype=case["reduce_dtype"]))
    engine.ledger.reset()
    own = _keep_own_counters(engine)
    first = _train_step(engine, rank, 0, case["accum"])
    windows = [_close_window(engine, own)]
    result = {"unit_numels": [u.numel for u in engine.units], "unit_sizes": [u.size for u in engine.units],
              "recomputing": [u.index for u in engine.units if u.recomputes], "memory": first, "windows": windows}
    if case["eval_iters"]:  # the trainer evaluates after the step's sync: the next window holds it
        _evaluate(engine, rank, case["eval_iters"])
        result["memory_after_eval"] = engine.model_state_bytes()
        _train_step(engine, rank, 1, case["accum"])
        windows.append(_close_window(engine, own))
    return result


def _cases_worker(rank: int, world_size: int, layout: list[int], cases: list[dict]) -> dict:
    groups_by_factors: dict = {}
    return {case["name"]: _run_case(rank, layout, case, groups_by_factors) for case in cases}


# ------------------------------------------------------------------------------------------ launches

@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Per layout key, the list of per-rank results; each layout launched once, on first use."""
    cache: dict = {}

    def get(key: str) -> list[dict]:
        if key not in cache:
            layout = LAYOUTS[key]
            n = 1
            for size in layout:
                n *= size
            cache[key] = run_ranks("test_ledger_equals_model:_cases_worker", n, tmp_path_factory.mktemp(key),
                                   layout=list(layout), cases=CASES[key])
        return cache[key]
    return get


def spec_for(layout_key: str, case: dict, window: int) -> CommSpec:
    """The model's description of window ``window`` (0: first step; 1: eval + second step)."""
    units = unit_parameter_counts(model_config(**case.get("model", {})), VOCAB)
    quant = QuantSpec(*case["quant"]) if case["quant"] else QuantSpec()
    return CommSpec(units, ShardLayout.resolve(LAYOUTS[layout_key], preset=case["preset"], shard_factors=case["factors"]), quant=quant,
                    micro_batches=case["accum"], compute_bytes=2 if case["precision"] == "bfloat16" else 4,
                    fp32_allreduce=case["fp32_allreduce"], cross_node_reduction=case["cross_node_reduction"],
                    reduce_bytes={None: None, "fp32": 4, "bf16": 2, "fp16": 2}[case["reduce_dtype"]],
                    checkpointed_units=transformer_block_units(len(units)) if case["checkpoint"] else frozenset(),
                    eval_forward_passes=case["eval_iters"] if window == 1 else 0)


def nonzero(ledger: dict) -> dict:
    return {key: nbytes for key, nbytes in ledger.items() if nbytes}


# The 2 x 2 layout is a second one (its own launch, ~6 s): under `make test-slow`; 2 x 2 x 2 carries every kind of case.
SECOND_LAYOUT = pytest.mark.slow
ALL_CASES = [pytest.param(key, case, id=f"{key}:{case['name']}", marks=[SECOND_LAYOUT] if key == "four" else [])
             for key in LAYOUTS for case in CASES[key]]


# ------------------------------------------------------------------------------------------ proofs

@pytest.mark.parametrize("layout_key", [pytest.param(k, marks=[SECOND_LAYOUT] if k == "four" else []) for k in LAYOUTS])
def test_unit_sizes_agree(launches, layout_key):
    """The engine's unpadded units are the model's P_u; its padded buffers are the model's S_u."""
    results = launches(layout_key)
    units = unit_parameter_counts(model_config(), VOCAB)
    assert all(p % 8 for p in units)  # padding is exercised on every unit at N = 8
    for rank_result in results:
        for name, run in rank_result.items():
            case = next(c for c in CASES[layout_key] if c["name"] == name)
            assert run["unit_numels"] == units
            assert tuple(run["unit_sizes"]) == padded_unit_numels(spec_for(layout_key, case, 0)), name


@pytest.mark.parametrize("layout_key, case", ALL_CASES)
def test_ledger_equals_model(launches, layout_key, case):
    """Proof 1: synced totals == predict_ledger, and each rank's own counters == its predicted row."""
    results = launches(layout_key)
    runs = [rank_result[case["name"]] for rank_result in results]
    if case["checkpoint"]:
        assert runs[0]["recomputing"] == sorted(transformer_block_units(len(runs[0]["unit_numels"])))
    assert len(runs[0]["windows"]) == (2 if case["eval_iters"] else 1)
    for window in range(len(runs[0]["windows"])):
        spec = spec_for(layout_key, case, window)
        totals = runs[0]["windows"][window]["totals"]
        assert all(run["windows"][window]["totals"] == totals for run in runs), "ranks disagree on the synced totals"
        assert nonzero(totals) == predict_ledger(spec), f"window {window}"
        per_rank = predict_ledger_per_rank(spec)
        for rank, run in enumerate(runs):
            assert nonzero(run["windows"][window]["own"]) == per_rank[rank], f"window {window}, rank {rank}"


def _as_model_categories(measured: dict) -> dict:
    # the same names on both sides (megatron.topology.names); error_feedback is reported (by both
    # sides) only when residuals are kept
    assert set(MEMORY_CATEGORIES) - {"error_feedback"} <= set(measured) <= set(MEMORY_CATEGORIES), \
        f"unexpected engine state categories {sorted(measured)}"
    out = dict(measured)
    out["total"] = sum(measured.values())
    return out


@pytest.mark.parametrize("layout_key, case", ALL_CASES)
def test_memory_equals_model(launches, layout_key, case):
    """Proof 2: model-state bytes per rank, by category, == predict_model_state_bytes.

    The model counts zeropp's secondary copy, which the engine holds from the first gather after a
    step until the next step: measured before the optimizer step it matches in full; right after the
    step the engine has dropped it and every other category is unchanged."""
    results = launches(layout_key)
    predicted = predict_model_state_bytes(spec_for(layout_key, case, 0))
    for rank, rank_result in enumerate(results):
        run = rank_result[case["name"]]
        expected = predicted[rank]
        assert _as_model_categories(run["memory"]["before_step"]) == expected, f"rank {rank}"
        after = dict(expected, secondary=0, total=expected["total"] - expected["secondary"])
        assert _as_model_categories(run["memory"]["after_step"]) == after, f"rank {rank}"
        if case["eval_iters"]:  # an eval forward since the step re-creates the secondary copy
            assert _as_model_categories(run["memory_after_eval"]) == expected, f"rank {rank}"
    if case["preset"] == "zeropp":
        assert predicted[0]["secondary"] > 0
