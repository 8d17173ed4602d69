"""load_hf on several ranks reads only what each rank keeps (megatron/checkpointing/hf_weights.py).

- HFWeights.read(name, lo, hi) returns exactly elements [lo, hi) of the flattened tensor for every
  range of 1-D and 2-D tensors, and counts exactly hi - lo elements read; each shard file is opened
  once however many tensors are read.
- The sharded build on 4 ranks (zero_topo and stage3 on 2 x 2) from a HF folder of two shard files:
  every read a rank makes lies inside its weight chunk or optimizer slice of the unit, it reads each
  kept element exactly once (the element count is the size of those ranges, padding excluded, well
  under the model), each shard is opened once per process, and the weights equal the HF folder's.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.checkpointing.hf import hf_config_dict, to_hf_state_dict
from megatron.checkpointing.hf_weights import HFWeights
from megatron.model import GPTNeoX
from test_engine import SEED, VOCAB, tiny_cfg
from test_sharded_build import meta_model

PRESETS = ("zero_topo", "stage3")


def _trained_model() -> GPTNeoX:
    torch.manual_seed(5)
    return GPTNeoX(tiny_cfg(no_weight_tying=True), VOCAB)


def _write_two_shards(model: GPTNeoX, folder) -> None:
    """A HF folder whose tensors are split over two safetensors files (as large models ship)."""
    folder.mkdir()
    state = {k: v.detach().contiguous() for k, v in to_hf_state_dict(dict(model.named_parameters()),
                                                                      model.config).items()}
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(model.config, VOCAB)))


def test_read_returns_exactly_the_range_and_counts_it(tmp_path):
    trained = _trained_model()
    _write_two_shards(trained, tmp_path / "hf")
    hf = HFWeights(tmp_path / "hf")
    assert hf.opens == 2  # each shard once, to list its tensors
    params = dict(trained.named_parameters())
    for name in ("embed.embed_in.weight", "layers.0.attention.query_key_value.weight",
                 "layers.1.mlp.dense_h_to_4h.bias"):
        flat = params[name].detach().reshape(-1)
        n = flat.numel()
        cols = params[name].shape[-1]
        cuts = sorted({0, 1, cols - 1, cols, cols + 3, 2 * cols + 1, n // 2, n - cols - 1, n - 1, n} & set(range(n + 1)))
        for lo in cuts:
            for hi in cuts:
                if hi < lo:
                    continue
                before = hf.elements_read
                got = hf.read(name, lo, hi)
                assert got.dtype == torch.float32 and torch.equal(got, flat[lo:hi]), (name, lo, hi)
                assert hf.elements_read - before == hi - lo, (name, lo, hi)
    assert hf.opens == 2  # no tensor read reopened a shard


class _RecordingHFWeights(HFWeights):
    """HFWeights that remembers every ``read`` and ``tensor`` call (the ranges a rank touched)."""

    def __init__(self, folder):
        super().__init__(folder)
        self.reads: list[tuple[str, int, int]] = []
        self.whole: list[str] = []

    def read(self, our_name, lo, hi):
        self.reads.append((our_name, lo, hi))
        return super().read(our_name, lo, hi)

    def tensor(self, our_name):
        self.whole.append(our_name)
        return super().tensor(our_name)


def _build_worker(rank: int, world_size: int, hf_folder: str) -> dict:
    import megatron.build as build
    from megatron.engine import Communicator, ZeroTopoEngine, lm_loss
    from megatron.topology import ProcessGroups, Topology
    from test_engine import OPT

    made = []

    def recording(folder):
        made.append(_RecordingHFWeights(folder))
        return made[-1]

    build.HFWeights = recording  # this rank's process only (dist_harness runs each rank fresh)
    out = {}
    for preset in PRESETS:
        model = meta_model(no_weight_tying=True)
        topology = Topology.simulated([2, 2])
        groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
        engine = ZeroTopoEngine(model, lm_loss, groups, Communicator(groups), EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1), device=torch.device("cpu"), materialize=build.unit_materializer(model, hf_folder))
        hf = made[-1]
        kept = {}  # parameter -> [lo, hi) ranges of it this rank keeps (weight chunk or optimizer slice)
        for unit in engine.units:
            for slot in unit.slots:
                for lo, hi in (unit.weight_range, unit.opt_range):
                    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if a < b:
                        kept.setdefault(slot.name, []).append((a - slot.offset, b - slot.offset))
        state = engine.full_state_dict()
        out[preset] = {"reads": hf.reads, "whole": hf.whole, "elements": hf.elements_read, "opens": hf.opens,
                       "kept": kept, "factors": engine.groups.factors.as_tuple(),
                       "params": sum(u.numel for u in engine.units),
                       "state": state if rank == 0 else None}
    return out


def _inside(lo: int, hi: int, ranges) -> bool:
    return any(a <= lo and hi <= b for a, b in ranges)


def _covered(ranges) -> int:
    """Elements in the union of [lo, hi) ranges."""
    total, reach = 0, -1
    for lo, hi in sorted(ranges):
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def test_each_rank_reads_only_its_slices_of_the_hf_folder(tmp_path):
    trained = _trained_model()
    _write_two_shards(trained, tmp_path / "hf")
    results = run_ranks("test_hf_slices:_build_worker", 4, tmp_path / "ranks", hf_folder=str(tmp_path / "hf"))
    for preset in PRESETS:
        for rank, result in enumerate(results):
            r = result[preset]
            assert r["reads"] and r["whole"] == [], (preset, rank)  # slices read, no parameter whole
            assert r["opens"] == 2, (preset, rank)    # each shard file opened once in this process
            for name, lo, hi in r["reads"]:
                assert _inside(lo, hi, r["kept"].get(name, [])), (preset, rank, name, lo, hi)
            kept = sum(_covered(ranges) for ranges in r["kept"].values())
            assert r["elements"] == kept, (preset, rank, r["elements"], kept)  # each kept element once
            w = r["factors"][0]
            # the weight chunk (the optimizer slice lies inside it): about 1/w of the model, not all of it
            assert kept <= r["params"] / w + 64 and kept < r["params"], (preset, rank, kept, r["params"])
        state = results[0][preset]["state"]
        for name, param in trained.named_parameters():
            assert torch.equal(state[name], param.detach()), (preset, name)


def test_single_process_materializer_reads_whole_tensors_with_each_shard_open_once(tmp_path):
    import megatron.build as build
    trained = _trained_model()
    _write_two_shards(trained, tmp_path / "hf")
    made = []
    real = build.HFWeights
    try:
        build.HFWeights = lambda folder: made.append(_RecordingHFWeights(folder)) or made[-1]
        model = meta_model(no_weight_tying=True)
        torch.manual_seed(SEED)
        materialize = build.unit_materializer(model, str(tmp_path / "hf"))
        for i, unit in enumerate(model.units()):
            assert materialize(i, unit) is None  # no `keep`: whole tensors, the unit's own checksum
    finally:
        build.HFWeights = real
    hf = made[0]
    assert hf.opens == 2 and hf.reads == [] and sorted(hf.whole) == sorted(dict(trained.named_parameters()))
    for name, param in trained.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], param), name
