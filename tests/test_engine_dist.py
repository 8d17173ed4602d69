"""ZeRO-topo engine on simulated topologies (gloo ranks): parity with the single-process reference
for every preset, the recompute path, bf16, the 2- and 4-rank layouts, sharded states, and which
(phase, tier) cells of the byte ledger carry bytes.

Launches are few and batched (8 ranks cost ~12 s to start on 2 cores): one 8-rank launch loops over
all presets; module-scoped fixtures let several tests judge one launch's results.
"""
from __future__ import annotations


import pytest
import torch

from dist_harness import RankFailure, run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.checkpointing.param_slices import assemble
from megatron.engine import fused_lm_loss, lm_loss
from megatron.topology import ProcessGroups, Topology, validate_factors
from megatron.engine import Communicator, EngineError, ZeroTopoEngine
from megatron.logging.host_syncs import HostSyncs
from megatron.config.quant_spec import QuantSpec
from test_engine import LR, OPT, TRAIN_LR, build_model, make_batch, max_param_diff, reference_run

STEPS, ACCUM = 3, 2
TOL = 1e-5


# ------------------------------------------------------------------------------------------ the worker

def _make_engine(rank: int, layout: list[int], run: dict, accum: int):
    if run.get("reentrant"):  # the model checkpoints non-re-entrantly; exercise the other path too

        import megatron.model.gpt_neox as gpt_neox
        from torch.utils.checkpoint import checkpoint
        gpt_neox.checkpoint = lambda fn, *args, **kw: checkpoint(fn, *args, **dict(kw, use_reentrant=True))
    model = build_model(checkpoint_activations=run.get("checkpoint_activations", False),
                        recompute_granularity=run.get("recompute_granularity", "full"), **run.get("model", {}))
    topology = Topology.simulated(layout)
    layout = (ShardLayout.from_topology(topology, validate_factors(topology.world_size, *run["factors"]))
              if "factors" in run else ShardLayout.from_topology(topology, preset=run.get("preset")))
    groups = ProcessGroups(topology, layout, rank)
    comm = Communicator(groups)
    loss_fn = fused_lm_loss if run.get("fused_cross_entropy") else lm_loss
    quant = QuantSpec(*run["quant"], impl="reference") if run.get("quant") else None  # (w, g, cross, refresh bits, block, EF)
    engine = ZeroTopoEngine(model, loss_fn, groups, comm, EngineSettings(optimizer=OPT, precision=run.get("precision", "fp32"), accumulation_steps=accum, cross_node_reduction=run.get("cross_node_reduction", "reduce_scatter"), quant=quant))
    if run.get("compile"):  # training.compile: after the engine, which swaps the parameters for views
        from megatron.build import compile_blocks
        compile_blocks(model)
    return engine, comm


def _watch_cross_all_reduces(engine: ZeroTopoEngine, comm: Communicator) -> list:
    """Record every cross_grad_reduce all-reduce as (elements, dtype, whether its buffer is the unit's
    fp32 accumulator itself): in fp32 the paper's hop adds no buffer, it sums the accumulator in place."""
    accumulators = {u.grad_accum.data_ptr(): u.grad_accum.numel() for u in engine.units}
    seen, inner = [], comm.all_reduce

    def all_reduce(buf, group, phase):
        if phase == "cross_grad_reduce":
            seen.append((buf.numel(), str(buf.dtype), accumulators.get(buf.data_ptr()) == buf.numel()))
        return inner(buf, group, phase)
    comm.all_reduce = all_reduce
    return seen


def _train(engine: ZeroTopoEngine, comm: Communicator, rank: int, world_size: int, steps: int, accum: int,
           repeat_batch: bool = False, lr: float = LR) -> dict:
    """The trainer's step order: micro-batches, optimizer step, loss all-reduce carrying the ledger.
    Also the host reads (syncs on a GPU) of the engine's forward-backward and optimizer step."""
    losses, norms, ledgers, reads = [], [], [], []
    for step in range(steps):
        comm.ledger.reset()
        with HostSyncs() as backward_reads:
            micro_losses = [engine.forward_backward(make_batch(0 if repeat_batch else step, m, rank))
                            for m in range(accum)]
        local = [loss.item() for loss in micro_losses]
        with HostSyncs() as step_reads:
            out = engine.optimizer_step(lr)
        reads.append((backward_reads.count, step_reads.count))
        losses.append(engine.all_reduce_sum([sum(local)], sync_ledger=True)[0] / (world_size * accum))
        norms.append(out["grad_norm"])
        ledgers.append(engine.synced_ledger())
    return {"losses": losses, "norms": norms, "ledgers": ledgers, "host_reads": reads}


def _runs_worker(rank: int, world_size: int, layout: list[int], runs: list[dict], steps: int, accum: int) -> dict:
    results = {}
    for run in runs:
        engine, comm = _make_engine(rank, layout, run, accum)
        cross_all_reduces = _watch_cross_all_reduces(engine, comm)
        result = _train(engine, comm, rank, world_size, run.get("steps", steps), accum,
                        run.get("repeat_batch", False), run.get("lr", LR))
        result["unit_sizes"] = [u.size for u in engine.units]
        result["blocks"] = [i for i, u in enumerate(engine.units) if u.recomputes]
        result["memory"] = engine.model_state_bytes()
        result["cross_all_reduces"] = list(cross_all_reduces)
        comm.ledger.reset()
        result["eval"] = engine.eval_loss(make_batch(99, 0, rank)).item()
        result["eval_ledger"] = comm.ledger.snapshot()
        if run.get("state", True):
            state = engine.full_state_dict()
            if rank == 0:
                result["params"] = state
        results[run["name"]] = result
    return results


def _state_worker(rank: int, world_size: int, layout: list[int], preset: str, model: dict | None = None) -> dict:
    """Sharded state round trip, and loading full tensors into another layout (zero_topo -> stage3).
    ``model``: ModelConfig overrides of the tiny model (the Llama-shaped case)."""
    model = model or {}
    engine, comm = _make_engine(rank, layout, {"preset": preset, "model": model}, 1)
    _train(engine, comm, rank, world_size, 1, 1)
    states = [None] * world_size
    torch.distributed.all_gather_object(states, engine.checkpoint_state())
    saved = assemble(states)
    full = engine.full_state_dict()
    _train(engine, comm, rank, world_size, 1, 1)
    after_two = engine.full_state_dict()
    engine.load_full_state(saved)
    reloaded_equal = all(torch.equal(full[k], v) for k, v in engine.full_state_dict().items())
    # Another layout from full tensors (parameters only, fresh moments in both runs).
    other, other_comm = _make_engine(rank, layout, {"preset": "stage3", "model": model}, 1)
    other.load_full_state_dict(full)
    engine.load_full_state_dict(full)
    a = _train(engine, comm, rank, world_size, 1, 1)
    b = _train(other, other_comm, rank, world_size, 1, 1)
    pa, pb = engine.full_state_dict(), other.full_state_dict()
    return {"reloaded_equal": reloaded_equal, "after_two": after_two, "saved_pieces": [(p["name"], p["offset"], p["length"]) for p in states[rank]["pieces"]],
            "loss_a": a["losses"], "loss_b": b["losses"], "cross_layout_diff": max_param_diff(pa, pb)}


def _raising_worker(rank: int, world_size: int) -> float:
    if rank == 1:
        raise ValueError("planned failure on rank 1")
    buf = torch.ones(1)
    torch.distributed.all_reduce(buf)  # rank 0 blocks here until rank 1's exit closes the pair
    return buf.item()


def _mismatched_init_worker(rank: int, world_size: int) -> str:
    torch.manual_seed(rank)  # a different init on every rank: the engine must refuse
    model = build_model()
    if rank:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    topology = Topology.simulated([world_size, 1])
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset="stage3"), rank)
    try:
        ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1))
    except EngineError as err:
        return str(err)
    return "no error"


# ------------------------------------------------------------------------------------ 8 ranks, 2x2x2

RUNS_8 = [
    {"name": "stage0", "preset": "stage0"}, {"name": "stage1", "preset": "stage1"},
    {"name": "stage2", "preset": "stage2"}, {"name": "stage3", "preset": "stage3"},
    {"name": "hsdp", "preset": "hsdp"}, {"name": "zeropp", "preset": "zeropp"},
    {"name": "zero_topo", "preset": "zero_topo"}, {"name": "explicit_2_4_8", "factors": [2, 4, 8]},
    {"name": "explicit_1_2_4", "factors": [1, 2, 4]},
    {"name": "zero_topo_recompute", "preset": "zero_topo", "checkpoint_activations": True},
    # the paper's step-boundary hop: cross pairs (2, 4, 8), and cross groups of 4 over both tiers (1, 2, 8)
    {"name": "zero_topo_all_reduce", "preset": "zero_topo", "cross_node_reduction": "all_reduce"},
    {"name": "all_reduce_1_2_8", "factors": [1, 2, 8], "cross_node_reduction": "all_reduce"},
    {"name": "zero_topo_bf16", "preset": "zero_topo", "precision": "bfloat16", "steps": 6, "repeat_batch": True,
     "lr": TRAIN_LR, "state": False},
]
EXACT_8 = [r["name"] for r in RUNS_8 if r.get("precision") is None]


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    results = run_ranks("test_engine_dist:_runs_worker", 8, tmp_path_factory.mktemp("eight"),
                        layout=[2, 2, 2], runs=RUNS_8, steps=STEPS, accum=ACCUM)
    return results, reference_run(8, STEPS, ACCUM)


def test_no_host_sync_but_the_norm(eight_ranks):
    """What would stall a GPU's queue, counted on every rank of every preset: no host read in forward
    and backward (hooks, gathers, reductions, recompute), one per optimizer step (the global norm)."""
    results, _ = eight_ranks
    for rank, result in enumerate(results):
        for run in RUNS_8:
            assert result[run["name"]]["host_reads"] == [(0, 1)] * run.get("steps", STEPS), (rank, run["name"])


@pytest.mark.parametrize("name", EXACT_8)
def test_eight_rank_presets_match_reference(eight_ranks, name):
    results, ref = eight_ranks
    for rank_result in results:  # every rank reports the same global losses and norms
        run = rank_result[name]
        assert run["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert run["norms"] == pytest.approx(ref["norms"], rel=TOL)
    assert max_param_diff(results[0][name]["params"], ref["params"]) < TOL


def test_bf16_trains_on_eight_ranks(eight_ranks):
    losses = eight_ranks[0][0]["zero_topo_bf16"]["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1


def test_recompute_path_detected(eight_ranks):
    run = eight_ranks[0][0]["zero_topo_recompute"]
    assert run["blocks"] == [1, 2]  # the two transformer blocks, not the embedding or the head


# ------------------------------------------------------------------------- the ledger on 8 ranks

def _nonzero(ledger: dict) -> set[tuple[str, str]]:
    return {key for key, nbytes in ledger.items() if nbytes}


def test_ledger_zero_topo_cells(eight_ranks):
    """(2, 4, 8) on 2x2x2: weights move only inside the GCD pair, gradients inside the node, and only
    the step-boundary hops cross nodes."""
    run = eight_ranks[0][0]["zero_topo"]
    ledger = run["ledgers"][0]
    assert _nonzero(ledger) == {
        ("fwd_gather", "intra_gpu"), ("bwd_gather", "intra_gpu"),
        ("grad_reduce", "intra_gpu"), ("grad_reduce", "intra_node"),
        ("cross_grad_reduce", "inter_node"),
        ("refresh", "inter_node"), ("refresh", "intra_node"),
        ("control", "intra_gpu"), ("control", "intra_node"), ("control", "inter_node"),
    }
    # Hand count (docs/engine.md): 8 ranks x 2 micro-batches x sum(S) x 4 bytes x (w-1)/w per gather.
    # The last unit stays gathered from its forward to its backward: no backward gather for it.
    total = sum(run["unit_sizes"])
    assert ledger[("fwd_gather", "intra_gpu")] == 8 * ACCUM * total * 4 // 2
    assert ledger[("bwd_gather", "intra_gpu")] == 8 * ACCUM * (total - run["unit_sizes"][-1]) * 4 // 2
    # Weight-pair reduce-scatter of S, then stride-pair reduce-scatter of S/2.
    assert ledger[("grad_reduce", "intra_gpu")] == 8 * ACCUM * total * 4 // 2
    assert ledger[("grad_reduce", "intra_node")] == 8 * ACCUM * (total // 2) * 4 // 2
    # Once per step: cross pair on S/4, refresh cross pair (S/4 out) and stride pair (S/2 out).
    assert ledger[("cross_grad_reduce", "inter_node")] == 8 * (total // 4) * 4 // 2
    assert ledger[("refresh", "inter_node")] == 8 * (total // 4) * 4 // 2
    assert ledger[("refresh", "intra_node")] == 8 * (total // 2) * 4 // 2
    # Same table every step.
    assert run["ledgers"][1] == ledger == run["ledgers"][2]


def test_paper_all_reduce_doubles_the_cross_hop_in_place(eight_ranks):
    """cross_node_reduction all_reduce: only the cross hop changes, to twice the reduce-scatter's bytes,
    and it sums each unit's fp32 S/g accumulator itself, once per unit per step (no extra buffer)."""
    ours, paper = eight_ranks[0][0]["zero_topo"], eight_ranks[0][0]["zero_topo_all_reduce"]
    for mine, theirs in zip(ours["ledgers"], paper["ledgers"]):
        for key, nbytes in mine.items():
            assert theirs[key] == (2 * nbytes if key[0] == "cross_grad_reduce" else nbytes), key
    assert paper["ledgers"][0][("cross_grad_reduce", "inter_node")] > 0
    assert ours["cross_all_reduces"] == []
    for rank_result in eight_ranks[0]:
        for name, g in (("zero_topo_all_reduce", 4), ("all_reduce_1_2_8", 2)):
            run = rank_result[name]
            assert run["cross_all_reduces"] == [(s // g, "torch.float32", True) for s in run["unit_sizes"]] * STEPS


def test_ledger_recompute_relabelled(eight_ranks):
    run = eight_ranks[0][0]["zero_topo_recompute"]
    ledger, sizes = run["ledgers"][0], run["unit_sizes"]
    blocks = sum(sizes[i] for i in run["blocks"])
    others = sum(sizes) - blocks - sizes[-1]  # the last unit is not gathered again for its backward
    assert ledger[("recompute_gather", "intra_gpu")] == 8 * ACCUM * blocks * 4 // 2
    assert ledger[("bwd_gather", "intra_gpu")] == 8 * ACCUM * others * 4 // 2
    # After the first step the engine knows which units recompute: the same table.
    assert run["ledgers"][1] == ledger


def test_ledger_stage_cells(eight_ranks):
    first = {name: eight_ranks[0][0][name]["ledgers"][0] for name in ("stage0", "stage1", "stage2", "stage3",
                                                                       "hsdp", "zeropp")}
    tiers = {"intra_gpu", "intra_node", "inter_node"}
    # DDP: only the replica all-reduce (and control) moves bytes.
    assert {p for p, _ in _nonzero(first["stage0"])} == {"replica_allreduce", "control"}
    assert {p for p, _ in _nonzero(first["stage1"])} == {"cross_grad_reduce", "refresh", "control"}
    assert {p for p, _ in _nonzero(first["stage2"])} == {"grad_reduce", "refresh", "control"}
    assert {p for p, _ in _nonzero(first["stage3"])} == {"fwd_gather", "bwd_gather", "grad_reduce", "control"}
    # A node-ordered ring over the world crosses every tier.
    assert {t for p, t in _nonzero(first["stage3"]) if p == "fwd_gather"} == tiers
    # HSDP keeps gathers and gradient reductions inside the node; only replicas cross.
    assert {t for p, t in _nonzero(first["hsdp"]) if p in ("fwd_gather", "bwd_gather", "grad_reduce")} <= {"intra_gpu", "intra_node"}
    assert {t for p, t in _nonzero(first["hsdp"]) if p == "replica_allreduce"} == {"inter_node"}
    # zeropp: the first gather is global, backward gathers stay in the node, no refresh.
    zpp = first["zeropp"]
    assert zpp[("fwd_gather", "inter_node")] > 0 and zpp[("bwd_gather", "inter_node")] == 0
    assert zpp[("bwd_gather", "intra_node")] > 0
    assert all(zpp[("refresh", t)] == 0 and zpp[("cross_grad_reduce", t)] == 0 for t in tiers)


def test_memory_per_rank(eight_ranks):
    sizes = eight_ranks[0][0]["zero_topo"]["unit_sizes"]
    total = sum(sizes)
    mem = eight_ranks[0][0]["zero_topo"]["memory"]
    # (2, 4, 8) fp32: weight chunk S/2, accumulator S/4, master S/8, moments 2 x S/8.
    assert mem == {"weights": total * 4 // 2, "secondary": 0, "grad_accumulator": total * 4 // 4,
                   "master": total * 4 // 8, "moments": 2 * total * 4 // 8}
    assert eight_ranks[0][0]["stage0"]["memory"]["weights"] == total * 4


# ---------------------------------------------------------------------------- 4 and 2 ranks

RUNS_4 = [{"name": "zero_topo", "preset": "zero_topo"}, {"name": "stage3", "preset": "stage3"},
          {"name": "zeropp", "preset": "zeropp"}, {"name": "hsdp", "preset": "hsdp"},
          {"name": "recompute", "preset": "stage3", "checkpoint_activations": True},
          {"name": "zeropp_recompute", "preset": "zeropp", "checkpoint_activations": True},
          # training.fused_cross_entropy: the head's loss through the engine's hooks (eval too)
          {"name": "zero_topo_fused_ce", "preset": "zero_topo", "fused_cross_entropy": True},
          {"name": "stage3_fused_ce_recompute", "preset": "stage3", "checkpoint_activations": True,
           "fused_cross_entropy": True},
          # recompute_granularity selective: no matmul recomputed, the same gathers as full recompute
          {"name": "selective_recompute", "preset": "stage3", "checkpoint_activations": True,
           "recompute_granularity": "selective"},
          # Last: it patches the model module's checkpoint function for the rest of the process.
          {"name": "reentrant_recompute", "preset": "zero_topo", "checkpoint_activations": True, "reentrant": True}]


def _four_rank_worker(rank: int, world_size: int, layout: list[int], runs: list[dict], steps: int, accum: int,
                      state_preset: str) -> dict:
    """The sharded-state round trip, then the runs: one launch for every 4-rank test here."""
    state = _state_worker(rank, world_size, layout, state_preset)  # first: the last run patches checkpointing
    return {"runs": _runs_worker(rank, world_size, layout, runs, steps, accum), "state": state}


@pytest.fixture(scope="module")
def four_rank_launch(tmp_path_factory):
    return run_ranks("test_engine_dist:_four_rank_worker", 4, tmp_path_factory.mktemp("four"),
                     layout=[2, 2], runs=RUNS_4, steps=STEPS, accum=ACCUM, state_preset="zero_topo")


@pytest.fixture(scope="module")
def four_ranks(four_rank_launch):
    return [r["runs"] for r in four_rank_launch], reference_run(4, STEPS, ACCUM)


@pytest.mark.parametrize("name", [r["name"] for r in RUNS_4])
def test_four_rank_layout_matches_reference(four_ranks, name):
    results, ref = four_ranks
    assert results[0][name]["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert max_param_diff(results[0][name]["params"], ref["params"]) < TOL


def test_the_fused_loss_moves_the_same_bytes(four_ranks):
    results, _ = four_ranks
    assert results[0]["zero_topo_fused_ce"]["ledgers"] == results[0]["zero_topo"]["ledgers"]
    assert results[0]["stage3_fused_ce_recompute"]["ledgers"] == results[0]["recompute"]["ledgers"]


def test_selective_recompute_moves_the_same_bytes(four_ranks):
    """A selectively checkpointed block still runs its forward again in backward (its LayerNorms need
    their weights), so the engine gathers it for the recompute exactly as under full recompute."""
    results, _ = four_ranks
    assert results[0]["selective_recompute"]["ledgers"] == results[0]["recompute"]["ledgers"]


@pytest.mark.parametrize("name", ["zero_topo", "zeropp", "stage3", "zero_topo_fused_ce"])
def test_eval_loss_matches_reference_model(four_ranks, name):
    results, ref = four_ranks
    model = build_model()
    model.load_state_dict(ref["params"], strict=False)
    with torch.no_grad():
        for rank, rank_result in enumerate(results):
            expected = lm_loss(model.eval(), make_batch(99, 0, rank)).item()
            assert rank_result[name]["eval"] == pytest.approx(expected, abs=TOL)
    ledger = results[0][name]["eval_ledger"]
    assert sum(v for (p, _), v in ledger.items() if p == "eval_gather") > 0
    assert sum(v for (p, _), v in ledger.items() if p != "eval_gather") == 0


@pytest.mark.parametrize("name", ["recompute", "reentrant_recompute"])
def test_four_rank_recompute_ledger(four_ranks, name):
    """Both checkpoint flavours charge the blocks' backward gathers to recompute_gather."""
    run = four_ranks[0][0][name]
    assert run["blocks"] == [1, 2]
    ledger = run["ledgers"][0]
    w = 4 if name == "recompute" else 2  # stage3 gathers over 4 ranks, zero_topo (2, 2, 4) over the pair
    blocks = sum(run["unit_sizes"][i] for i in run["blocks"])
    assert sum(v for (p, _), v in ledger.items() if p == "recompute_gather") == 4 * ACCUM * blocks * 4 * (w - 1) // w


def test_four_rank_zero_topo_is_2_2_4(four_ranks):
    """On the two-tier 2x2 layout the fastest tier is the node: gathers intra_node only."""
    ledger = four_ranks[0][0]["zero_topo"]["ledgers"][0]
    assert {t for p, t in _nonzero(ledger) if p in ("fwd_gather", "bwd_gather", "grad_reduce")} == {"intra_node"}
    assert ledger[("cross_grad_reduce", "inter_node")] > 0
    assert not any(t == "intra_gpu" for _, t in _nonzero(ledger))


def _two_rank_worker(rank: int, world_size: int, layout: list[int], runs: list[dict], steps: int,
                     accum: int) -> dict:
    """The runs, then the refused mismatched init (last: it leaves a half-built engine behind)."""
    return {"runs": _runs_worker(rank, world_size, layout, runs, steps, accum),
            "mismatched_init": _mismatched_init_worker(rank, world_size)}


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    runs = [{"name": "zero_topo", "preset": "zero_topo"}, {"name": "stage3", "preset": "stage3"}]
    return run_ranks("test_engine_dist:_two_rank_worker", 2, tmp_path_factory.mktemp("two"), layout=[2, 1],
                     runs=runs, steps=STEPS, accum=ACCUM)


def test_two_rank_layout_matches_reference(two_rank_launch):
    results = [r["runs"] for r in two_rank_launch]
    ref = reference_run(2, STEPS, ACCUM)
    for name in ("zero_topo", "stage3"):
        assert results[0][name]["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert max_param_diff(results[0][name]["params"], ref["params"]) < TOL


@pytest.mark.slow
def test_compiled_blocks_match_reference(tmp_path):
    """training.compile under the sharded engine: gathers into released storage, new parameter views
    per gather, the recompute of checkpointed blocks; the same training as the eager reference."""
    runs = [{"name": "stage3", "preset": "stage3", "compile": True},
            {"name": "zero_topo_recompute", "preset": "zero_topo", "checkpoint_activations": True, "compile": True}]
    results = run_ranks("test_engine_dist:_runs_worker", 2, tmp_path, layout=[2, 1], runs=runs, steps=STEPS, accum=ACCUM)
    ref = reference_run(2, STEPS, ACCUM)
    for name in ("stage3", "zero_topo_recompute"):
        assert results[0][name]["losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert max_param_diff(results[0][name]["params"], ref["params"]) < TOL
    assert results[0]["zero_topo_recompute"]["blocks"] == [1, 2]  # the recompute path ran


def test_sharded_state_and_cross_layout_load(four_rank_launch):
    results = [r["state"] for r in four_rank_launch]
    for r in results:
        assert r["reloaded_equal"]
        assert r["loss_a"] == pytest.approx(r["loss_b"], abs=1e-6)
        assert r["cross_layout_diff"] < 1e-6
    # Slice maps name real parameters and cover each rank's slice without overlap.
    assert all(length > 0 for _, _, length in results[1]["saved_pieces"])


def test_mismatched_init_is_refused(two_rank_launch):
    messages = [r["mismatched_init"] for r in two_rank_launch]
    assert all("different weights" in m for m in messages), messages


def test_harness_reports_the_rank_that_raised(tmp_path):
    """A rank that raises is reported (not its blocked peer's consequence), without waiting for timeouts."""
    with pytest.raises(RankFailure, match="planned failure on rank 1"):
        run_ranks("test_engine_dist:_raising_worker", 2, tmp_path, timeout_s=120)
