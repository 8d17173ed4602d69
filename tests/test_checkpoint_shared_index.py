"""Resuming a step without index.json opens each rank file a bounded number of times.

A step saved without index.json (before it existed, or by a save that could not gather) used to be
indexed by every rank: each read the piece lists of all N rank files, N x N opens (147,456 at 384
ranks). Now rank 0 reads them once and broadcasts the index (``CheckpointReader(share=...)``, the
trainer passes ``engine.broadcast_object``); rank 0 keeps those files mapped for its own data, so
it opens each file once, and every other rank opens only the files whose pieces overlap its
optimizer slices.

Measured here: a step written by 8 ranks (zero_topo on 2 x 2 x 2, os = 8: one piece set per rank
file), index.json removed, resumed through ``engine.load_checkpoint`` on 8 ranks (same layout) and
on 4 ranks (zero_topo on 2 x 2, os = 4). Counts per rank (``reader.opens``):

    8 -> 8 ranks: rank 0 opens all 8 files once; ranks 1..7 open 1 file each   -> 15 opens in all
    8 -> 4 ranks: rank 0 opens all 8 files once; ranks 1..3 open 2 files each  -> 14 opens in all

(before: 8 x 8 = 64 scan opens plus the data opens). At 384 ranks resuming the same layout the
same rule gives 384 + 383 x 1 = 767 opens in all, instead of 384 x 384 = 147,456 scan opens;
``test_resume_without_index_opens_each_file_once_on_rank_0_and_only_overlapping_ones_elsewhere``
computes that figure from the measured counts and states it in its assertion.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.checkpointing.rank_files import CheckpointError
from megatron.checkpointing.index import INDEX
from megatron.checkpointing.reader import CheckpointReader
from test_engine import LR, OPT, build_model, make_batch

SAVED_WORLD, SAVED_LAYOUT = 8, [2, 2, 2]
AT_SCALE = 384


def _engine(rank: int, layout: list, preset: str = "zero_topo"):
    from megatron.engine import Communicator, ZeroTopoEngine, lm_loss
    from megatron.topology import ProcessGroups, Topology

    topology = Topology.simulated(layout)
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    model = build_model()
    return ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1))


def _save_worker(rank: int, world_size: int, save_dir: str) -> str:
    import torch.distributed as dist
    from megatron.checkpointing.checkpointer import Checkpointer

    engine = _engine(rank, SAVED_LAYOUT)
    engine.forward_backward(make_batch(0, 0, rank))
    engine.optimizer_step(LR)  # moments and step 1: not a fresh optimizer
    checkpointer = Checkpointer(save_dir, rank=rank, world_size=world_size, barrier=dist.barrier)
    state = {"engine": engine.checkpoint_state(), "rng": {"torch": torch.get_rng_state()}}
    return str(checkpointer.save(1, state, {"consumed_samples": 0}, gather=engine.gather_objects))


@pytest.fixture(scope="module")
def step_without_index(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("shared_index")
    step = Path(run_ranks("test_checkpoint_shared_index:_save_worker", SAVED_WORLD, work / "save",
                          save_dir=str(work / "ck"))[0])
    (step / INDEX).unlink()  # what an old checkpoint looks like
    return step


def _resume_worker(rank: int, world_size: int, step_dir: str, layout: list) -> dict:
    from megatron.checkpointing.param_slices import assemble_full_state

    engine = _engine(rank, layout)
    reader = CheckpointReader(step_dir, rank, share=engine.broadcast_object)
    engine.load_checkpoint(reader)
    overlapping = set()  # from the shared index and this rank's optimizer slices alone
    for unit in engine.units:
        for slot in unit.slots:
            lo, hi = max(unit.opt_range[0], slot.offset), min(unit.opt_range[1], slot.offset + slot.numel)
            if lo < hi:
                overlapping |= reader.files_for(slot.name, lo - slot.offset, hi - slot.offset)
    oracle = _engine(rank, layout)
    oracle.load_full_state(assemble_full_state(Path(step_dir)))  # the full-tensor path, for the values
    same = engine.step_count == oracle.step_count == 1 and all(
        torch.equal(getattr(u, key), getattr(v, key)) for u, v in zip(engine.units, oracle.units)
        for key in ("shard", "master", "exp_avg", "exp_avg_sq"))
    return {"opens": dict(reader.opens), "scanned": list(reader.scanned), "overlapping": sorted(overlapping),
            "indexed": reader.indexed, "same": same}


def _check_counts(results: list[dict], saved_world: int) -> int:
    """Assert the per-rank rule; return the most files a rank other than 0 opened."""
    everything = {r: 1 for r in range(saved_world)}
    assert results[0]["scanned"] == list(range(saved_world)) and results[0]["opens"] == everything, results[0]
    for rank, r in enumerate(results):
        assert not r["indexed"] and r["same"], rank
        if rank > 0:
            assert r["scanned"] == [], rank  # the index came from rank 0
            assert r["opens"] == {f: 1 for f in r["overlapping"]}, (rank, r["opens"], r["overlapping"])
            assert 0 < len(r["opens"]) < saved_world, rank
    return max(len(r["opens"]) for r in results[1:])


def test_resume_without_index_opens_each_file_once_on_rank_0_and_only_overlapping_ones_elsewhere(
        step_without_index, tmp_path):
    same = run_ranks("test_checkpoint_shared_index:_resume_worker", 8, tmp_path / "on8",
                     step_dir=str(step_without_index), layout=SAVED_LAYOUT)
    assert "rank 0 reads the piece lists of all 8 rank files" in (tmp_path / "on8" / "rank0.log").read_text()
    per_rank_same = _check_counts(same, SAVED_WORLD)
    assert [len(r["opens"]) for r in same] == [8] + [1] * 7  # each rank its own file
    assert sum(len(r["opens"]) for r in same) == 15

    fewer = run_ranks("test_checkpoint_shared_index:_resume_worker", 4, tmp_path / "on4",
                      step_dir=str(step_without_index), layout=[2, 2])
    per_rank_fewer = _check_counts(fewer, SAVED_WORLD)
    assert [len(r["opens"]) for r in fewer] == [8, 2, 2, 2]  # os 8 -> 4: each slice spans two files
    assert per_rank_fewer == SAVED_WORLD // 4

    # The same rule at 384 ranks resuming the same layout: rank 0 opens every file once, each other
    # rank the files overlapping its slices (measured above: one), against N x N scan opens before.
    at_scale = AT_SCALE + (AT_SCALE - 1) * per_rank_same
    before = AT_SCALE * AT_SCALE
    assert (at_scale, before) == (767, 147_456), (
        f"at {AT_SCALE} ranks: {at_scale} rank-file opens in all (rank 0: {AT_SCALE}, the others "
        f"{per_rank_same} each), before: {before} scan opens")


def test_a_reader_alone_scans_every_file_and_reopens_none(step_without_index):
    """One process (tools, the single-process engine): no broadcast; the scan's maps are reused."""
    reader = CheckpointReader(step_without_index)
    for name in reader.shapes:
        reader.read(name, 0, reader.numel(name))
    assert reader.scanned == list(range(SAVED_WORLD)) and sorted(reader.opened) == list(range(SAVED_WORLD))
    assert dict(reader.opens) == {r: 1 for r in range(SAVED_WORLD)}
    reader.rank_state(3)["rng"]  # the RNG through the reader: no second open either
    assert reader.opens[3] == 1


def test_a_scan_that_fails_on_rank_0_fails_every_rank_alike(step_without_index, tmp_path, monkeypatch):
    """A rank file missing: rank 0's scan fails, and it still answers the broadcast, so the other
    ranks raise the same one-line error instead of waiting for an index that never comes."""
    import shutil

    step = tmp_path / step_without_index.name
    shutil.copytree(step_without_index, step)
    (step / "rank_00005.pt").unlink()
    sent = []
    with pytest.raises(CheckpointError) as first:
        CheckpointReader(step, 0, share=lambda obj: sent.append(obj) or obj)
    assert "rank_00005.pt is missing" in str(first.value)
    from megatron.checkpointing import reader as reader_module
    monkeypatch.setattr(reader_module, "scan_step", lambda *a, **k: pytest.fail("rank 3 scanned"))
    passed = []
    with pytest.raises(CheckpointError) as other:
        CheckpointReader(step, 3, share=lambda obj: passed.append(obj) or sent[0])
    assert str(other.value) == str(first.value) and passed == [(None, None)]  # rank 3 sent nothing
