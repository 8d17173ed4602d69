"""Checkpoint loading reads only what a rank needs (issue "The 20B must fit").

- index.json: written at save (threads stand in for ranks; and by a real 8-rank run through deepy),
  listing every rank file's pieces exactly as the files hold them.
- CheckpointReader: ranges across files, only overlapping files opened, bytes counted, incomplete
  ranges and missing files refused.
- 8 ranks zero3 (deepy) -> 4 ranks zero_topo (deepy): the resumed run continues like the reference;
  -> 4 ranks zero_topo / hsdp / zero_topo with INT8 refresh (dist_harness): every rank opens exactly
  the files whose pieces overlap its optimizer slice (computed here from index.json; the weight
  chunk is rebuilt by a refresh, not read), fewer than 8, copies exactly its slice sizes in bytes,
  and ends in the same state as the full-tensor path (`assemble_full_state` + `load_full_state`),
  bit for bit.
- A checkpoint without index.json (saved before it existed) loads, with the notice.
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_deepy, tiny_run_config, train_losses
from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.checkpointing.checkpointer import Checkpointer
from megatron.checkpointing.rank_files import CheckpointError, rank_file
from megatron.checkpointing.index import INDEX, scan_step
from megatron.checkpointing.param_slices import assemble_full_state, make_engine_state
from megatron.checkpointing.reader import CheckpointReader

SIM8_ZERO3 = [str(REPO / "configs/sim-2x2x2.yml"), str(REPO / "configs/zero3.yml")]
SIM4_TOPO = [str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero_topo.yml")]


# ------------------------------------------------------------------ synthetic steps, threads as ranks

def _piece(name, offset, length, base):
    values = torch.arange(offset, offset + length, dtype=torch.float32) + base
    return {"name": name, "offset": offset, "length": length,
            "master": values, "exp_avg": values + 0.25, "exp_avg_sq": values + 0.5}


# rank -> pieces of "a" (10 elements) and "b" (2x3); rank 3 is a replica that writes none
LAYOUT = {0: [("a", 0, 4)], 1: [("a", 4, 3)], 2: [("a", 7, 3), ("b", 0, 6)], 3: []}
SHAPES = {"a": (10,), "b": (2, 3)}


def _engine_state(rank):
    pieces = [_piece(n, o, l, 100.0 * (n == "b")) for n, o, l in LAYOUT[rank]]
    extra = {"loss_scaler": {"scale": 8.0, "clean_steps": 3}, "preset": "zero3"}
    if rank == 1:
        extra["error_feedback"] = {"rank": 1}
    return make_engine_state(pieces, SHAPES, 7, extra)


def _threaded_save(save_dir, with_gather: bool):
    world = len(LAYOUT)
    barrier = threading.Barrier(world)
    slots: list = [None] * world
    errors = []

    def run(rank):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            return list(slots)
        try:
            ck = Checkpointer(str(save_dir), rank=rank, world_size=world, barrier=barrier.wait)
            ck.save(7, {"engine": _engine_state(rank), "rng": {"torch": torch.get_rng_state()}},
                    {"consumed_samples": 0}, gather=gather if with_gather else None)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return save_dir / "global_step7"


@pytest.fixture
def synthetic(tmp_path):
    return _threaded_save(tmp_path / "ck", with_gather=True)


def test_index_lists_every_file_and_matches_a_scan(synthetic, tmp_path):
    index = json.loads((synthetic / INDEX).read_text())
    assert index["step"] == 7 and index["world_size"] == 4
    assert index["shapes"] == {"a": [10], "b": [2, 3]}
    assert index["shared"] == {"loss_scaler": {"scale": 8.0, "clean_steps": 3}, "preset": "zero3"}
    assert [f["file"] for f in index["files"]] == [rank_file(synthetic, r).name for r in range(4)]
    assert [[tuple(p) for p in f["pieces"]] for f in index["files"]] == [LAYOUT[r] for r in range(4)]
    assert [f["per_rank"] for f in index["files"]] == [[], ["error_feedback"], [], []]
    # the gather path and the fallback (rank 0 reads each file's piece list) write the same index
    assert scan_step(synthetic, 4) == index
    without = _threaded_save(tmp_path / "ck2", with_gather=False)
    assert json.loads((without / INDEX).read_text()) == index


def test_reader_opens_only_overlapping_files_and_counts_bytes(synthetic):
    reader = CheckpointReader(synthetic)
    got = reader.read("a", 3, 8)
    assert reader.opened == [0, 1, 2] and reader.bytes_copied == 5 * 4 * 3
    assert torch.equal(got["master"], torch.arange(3, 8, dtype=torch.float32))
    assert torch.equal(got["exp_avg_sq"], torch.arange(3, 8, dtype=torch.float32) + 0.5)

    reader = CheckpointReader(synthetic)
    assert reader.files_for("a", 4, 7) == {1}
    got = reader.read("a", 5, 6, keys=("master",))
    assert reader.opened == [1] and reader.bytes_copied == 4 and got["master"].tolist() == [5.0]
    assert reader.read("b", 2, 6)["exp_avg"].tolist() == [102.25, 103.25, 104.25, 105.25]
    assert reader.opened == [1, 2]  # each file opened once, lazily
    reader.read("a", 7, 9)
    assert reader.opened == [1, 2]
    assert reader.read("a", 2, 2, keys=("master",))["master"].numel() == 0
    assert reader.shared["loss_scaler"]["scale"] == 8.0 and reader.step == 7
    assert reader.ranks_with("error_feedback") == [1]
    assert reader.rank_entry(0, "error_feedback") is None and reader.opened == [1, 2]  # not opened
    assert reader.rank_entry(1, "error_feedback") == {"rank": 1}
    with pytest.raises(CheckpointError, match="outside"):
        reader.read("a", 5, 11)
    with pytest.raises(CheckpointError, match="no parameter"):
        reader.read("c", 0, 1)


def test_uncovered_range_and_missing_file_are_refused(synthetic):
    index = json.loads((synthetic / INDEX).read_text())
    index["files"][1]["pieces"] = []  # a piece no file lists any more
    (synthetic / INDEX).write_text(json.dumps(index))
    reader = CheckpointReader(synthetic)
    assert torch.equal(reader.read("a", 0, 4)["master"], torch.arange(4, dtype=torch.float32))
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        reader.read("a", 2, 6)
    rank_file(synthetic, 2).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointReader(synthetic).read("a", 8, 9)


def test_no_index_for_states_that_are_not_engine_states(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), rank=0, world_size=1, barrier=lambda: None)
    path = ck.save(1, {"w": torch.ones(2)}, {})
    assert not (path / INDEX).exists() and (path / "meta.json").is_file()


# ------------------------------------------------------------------ a real run: 8 ranks zero3 via deepy

def _config(folder, corpus, **overrides):
    folder.mkdir(parents=True)
    base = dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, lr_decay_iters=4, log_interval=1,
                eval_iters=0, eval_interval=100)
    return tiny_run_config(folder, corpus, **{**base, **overrides})


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_corpus):
    """4 steps on 8 ranks zero3 (shard factors (8, 8, 8)), a checkpoint at steps 2 and 4."""
    folder = tmp_path_factory.mktemp("zero3") / "a"
    cfg = _config(folder, tiny_corpus, train_iters=4, checkpoint_factor=2, save=str(folder / "ck"))
    result = run_deepy("train.py", str(cfg), *SIM8_ZERO3)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def _copy_step(zero3_run, dest, step=2, drop_index=False):
    dest.mkdir(parents=True)
    shutil.copytree(zero3_run / "ck" / f"global_step{step}", dest / f"global_step{step}")
    (dest / "latest").write_text(f"global_step{step}")
    if drop_index:
        (dest / f"global_step{step}" / INDEX).unlink()
    return dest / f"global_step{step}"


def test_eight_rank_save_writes_the_index(zero3_run):
    step = zero3_run / "ck" / "global_step2"
    index = json.loads((step / INDEX).read_text())
    assert index["world_size"] == 8 and index["step"] == 2
    for rank, entry in enumerate(index["files"]):
        pieces = torch.load(rank_file(step, rank), mmap=True, weights_only=False)["engine"]["pieces"]
        assert entry["pieces"] == [[p["name"], p["offset"], p["length"]] for p in pieces], rank


def test_an_eight_rank_resume_trains_bit_for_bit_what_the_run_that_went_on_trained(zero3_run, tmp_path, tiny_corpus):
    """Step 2's checkpoint resumed on the same 8 ranks: steps 3 and 4 log the same losses as the run
    that saved it and went on, and step 4's saved states are the same bits (test_reshard.py's chain
    across layouts is slow)."""
    ck = _copy_step(zero3_run, tmp_path / "ck").parent
    cfg = _config(tmp_path / "b", tiny_corpus, train_iters=4, load=str(ck), save=str(tmp_path / "b" / "ck"))
    result = run_deepy("train.py", str(cfg), *SIM8_ZERO3)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout, result.stdout[-2000:]
    reference, resumed = train_losses(zero3_run / "logs"), train_losses(tmp_path / "b" / "logs")
    assert sorted(resumed) == [3, 4] and all(resumed[it] == reference[it] for it in (3, 4)), (resumed, reference)
    went_on, again = (assemble_full_state(folder / "global_step4") for folder in (zero3_run / "ck", tmp_path / "b" / "ck"))
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert went_on[key].keys() == again[key].keys()
        assert all(torch.equal(went_on[key][name], again[key][name]) for name in went_on[key]), key


def test_resume_on_four_ranks_zero_topo_continues(zero3_run, tmp_path, tiny_corpus):
    ck = _copy_step(zero3_run, tmp_path / "ck").parent
    cfg = _config(tmp_path / "b", tiny_corpus, train_iters=4, load=str(ck))
    result = run_deepy("train.py", str(cfg), *SIM4_TOPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "of 8 rank files" in result.stdout, result.stdout[-2000:]
    reference, resumed = train_losses(zero3_run / "logs"), train_losses(tmp_path / "b" / "logs")
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert abs(resumed[it] - reference[it]) < 1e-5, (it, resumed[it], reference[it])


def test_old_format_checkpoint_loads_with_notice(zero3_run, tmp_path, capsys):
    """No index.json: the reader indexes the step from the files (one-line notice); a single
    process loads the 8-rank checkpoint through it exactly."""
    from megatron.checkpointing.rank_files import load_meta
    from megatron.config import config_from_dict
    from megatron.engine import SingleProcessEngine, lm_loss
    from megatron.model import GPTNeoX

    step = _copy_step(zero3_run, tmp_path / "ck", drop_index=True)
    cfg = config_from_dict(load_meta(step)["config"])
    model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    engine = SingleProcessEngine(model, lm_loss, cfg.optimizer, "fp32", 1, torch.device("cpu"))
    reader = CheckpointReader(step)
    assert "has no index.json" in capsys.readouterr().out
    assert not reader.indexed and reader.scanned == list(range(8))
    engine.load_checkpoint(reader)
    full = assemble_full_state(step)
    for name, param in model.named_parameters():
        state = engine.optimizer.state[param]
        assert torch.equal(param.detach(), full["params"][name]), name
        assert torch.equal(state["exp_avg"], full["exp_avg"][name]) and int(state["step"]) == 2
        assert torch.equal(state["exp_avg_sq"], full["exp_avg_sq"][name])
    fresh = SingleProcessEngine(GPTNeoX(cfg.model, cfg.model.padded_vocab_size), lm_loss, cfg.optimizer, "fp32", 1,
                        torch.device("cpu"))
    fresh.load_checkpoint(CheckpointReader(step), weights_only=True)  # finetune: weights, no moments
    assert not fresh.optimizer.state
    assert all(torch.equal(p.detach(), full["params"][n]) for n, p in fresh.model.named_parameters())


# ------------------------------------------------------------------ per rank, via dist_harness

# (name, preset, refresh_bits, weights_only): the weight chunk is rebuilt from the loaded 1/os
# master slices by the engine's refresh (INT8 with refresh_bits 8)
LOAD_CASES = (("zero_topo", "zero_topo", 0, False), ("hsdp", "hsdp", 0, False),
              ("zero_topo_int8_refresh", "zero_topo", 8, False), ("zero_topo_weights_only", "zero_topo", 0, True))


def _expected_reads(engine, index: dict, weights_only: bool) -> tuple[set[int], int]:
    """From index.json's piece lists and this rank's ranges alone: the files whose pieces overlap
    the rank's optimizer slice, and the fp32 bytes of them."""
    files, nbytes = set(), 0
    states = 1 if weights_only else 3
    for unit in engine.units:
        lo, hi = unit.opt_range
        for slot in unit.slots:
            a, b = max(lo, slot.offset) - slot.offset, min(hi, slot.offset + slot.numel) - slot.offset
            if a >= b:
                continue
            nbytes += 4 * states * (b - a)
            for rank, entry in enumerate(index["files"]):
                if any(n == slot.name and o < b and o + l > a for n, o, l in entry["pieces"]):
                    files.add(rank)
    return files, nbytes


def _load_worker(rank: int, world_size: int, step_dir: str, legacy_dir: str) -> dict:
    from megatron.checkpointing.rank_files import load_meta
    from megatron.config import config_from_dict
    from megatron.engine import lm_loss
    from megatron.model import GPTNeoX
    from megatron.topology import ProcessGroups, Topology
    from megatron.engine import Communicator, ZeroTopoEngine
    from megatron.engine.quantized import QuantSpec

    step_dir, legacy_dir = Path(step_dir), Path(legacy_dir)
    cfg = config_from_dict(load_meta(step_dir)["config"])
    index = json.loads((step_dir / INDEX).read_text())
    topology = Topology.simulated([2, 2])
    full = assemble_full_state(step_dir)  # the oracle: the full-tensor path
    zeros = {name: torch.zeros_like(t) for name, t in full["params"].items()}

    def make(preset, refresh_bits):
        torch.manual_seed(0)
        model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
        groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
        return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=cfg.optimizer, precision="fp32", accumulation_steps=1, quant=QuantSpec(refresh_bits=refresh_bits, block_size=16)))

    def same(a, b) -> bool:
        return a.step_count == b.step_count and all(
            torch.equal(getattr(u, k), getattr(v, k)) for u, v in zip(a.units, b.units)
            for k in ("shard", "master", "exp_avg", "exp_avg_sq"))

    out = {}
    for name, preset, refresh_bits, weights_only in LOAD_CASES:
        engine = make(preset, refresh_bits)
        reader = CheckpointReader(step_dir, rank)
        engine.load_checkpoint(reader, weights_only=weights_only)  # the training path
        oracle = make(preset, refresh_bits)
        oracle.load_full_state({**full, "step": 0, "exp_avg": zeros, "exp_avg_sq": zeros} if weights_only else full)
        files, nbytes = _expected_reads(engine, index, weights_only)
        out[name] = {"opened": list(reader.opened), "expected_files": files, "bytes": reader.bytes_copied,
                     "expected_bytes": nbytes, "same_as_full_path": same(engine, oracle),
                     "factors": engine.groups.factors.as_tuple(), "step": engine.step_count,
                     "params": sum(u.numel for u in engine.units), "padded": sum(u.size for u in engine.units)}
        if name == "zero_topo":  # the gathered state equals the checkpoint's full tensors
            params = engine.full_state_dict()
            out[name]["full_equal"] = all(torch.equal(params[n], full["params"][n]) for n in full["params"])
    legacy_engine = make("zero_topo", 0)
    legacy = CheckpointReader(legacy_dir, rank)
    legacy_engine.load_checkpoint(legacy)
    oracle = make("zero_topo", 0)
    oracle.load_full_state(full)
    out["legacy"] = {"scanned": legacy.scanned, "indexed": legacy.indexed, "same_as_full_path": same(legacy_engine, oracle)}
    return out


def test_each_rank_reads_only_the_files_overlapping_its_slices(zero3_run, tmp_path):
    step = zero3_run / "ck" / "global_step2"
    legacy = _copy_step(zero3_run, tmp_path / "legacy", drop_index=True)
    results = run_ranks("test_checkpoint_reader:_load_worker", 4, tmp_path / "ranks",
                        step_dir=str(step), legacy_dir=str(legacy))
    assert "has no index.json" in (tmp_path / "ranks" / "rank0.log").read_text()
    for name, _preset, _bits, weights_only in LOAD_CASES:
        fewer = []
        for rank, result in enumerate(results):
            r = result[name]
            assert r["same_as_full_path"], (name, rank)
            assert set(r["opened"]) == r["expected_files"] and len(r["opened"]) == len(set(r["opened"])), (name, rank, r)
            assert r["bytes"] == r["expected_bytes"], (name, rank, r["bytes"], r["expected_bytes"])
            full_model = 3 * 4 * r["params"]  # every parameter and both moments, fp32
            _w, _g, os = r["factors"]
            # ~ the rank's optimizer slices (3 states, or the master alone), not the model
            assert r["bytes"] <= 4 * r["padded"] * (1 if weights_only else 3) / os < full_model
            assert r["step"] == (0 if weights_only else 2)
            fewer.append(len(r["opened"]) < 8)
        assert any(fewer), name
    assert all(result["zero_topo"]["full_equal"] for result in results)
    for result in results:
        assert result["legacy"]["scanned"] == list(range(8)) and not result["legacy"]["indexed"]
        assert result["legacy"]["same_as_full_path"]
