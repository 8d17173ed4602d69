"""The sharded build: the model on the meta device, made real one unit at a time, keeps exactly the
weights of a whole model built on the CPU (the single-process reference), from NeoX's init or from a
Hugging Face folder read one tensor at a time."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_deepy, run_together, tiny_run_config
from dist_harness import run_ranks
from megatron.engine.settings import EngineSettings
from megatron.topology.layout import ShardLayout
from megatron.build import unit_materializer
from megatron.checkpointing.hf import hf_config_dict, to_hf_state_dict
from megatron.engine import lm_loss
from megatron.model import GPTNeoX
from megatron.topology import ProcessGroups, Topology
from megatron.engine import Communicator, ZeroTopoEngine
from test_engine import OPT, SEED, VOCAB, tiny_cfg


def meta_model(**overrides) -> GPTNeoX:
    torch.manual_seed(SEED)
    with torch.device("meta"):
        return GPTNeoX(tiny_cfg(**overrides), VOCAB)


def write_hf_folder(model: GPTNeoX, folder) -> None:
    folder.mkdir()
    state = {k: v.contiguous() for k, v in to_hf_state_dict(dict(model.named_parameters()), model.config).items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(hf_config_dict(model.config, VOCAB)))


def test_unit_by_unit_init_equals_the_whole_model_and_leaves_the_rng_alike():
    torch.manual_seed(SEED)
    reference = GPTNeoX(tiny_cfg(no_weight_tying=True), VOCAB)
    after_reference = torch.random.get_rng_state()
    model = meta_model(no_weight_tying=True)
    materialize = unit_materializer(model)
    for i, unit in enumerate(model.units()):
        assert all(p.is_meta for p in unit.parameters())
        materialize(i, unit)
    assert torch.equal(torch.random.get_rng_state(), after_reference)  # the run continues identically
    for name, param in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], param), name


def test_materializer_reads_the_hf_folder_tensor_by_tensor(tmp_path):
    torch.manual_seed(5)
    trained = GPTNeoX(tiny_cfg(no_weight_tying=True), VOCAB)
    write_hf_folder(trained, tmp_path / "hf")
    model = meta_model(no_weight_tying=True)
    materialize = unit_materializer(model, str(tmp_path / "hf"))
    for i, unit in enumerate(model.units()):
        materialize(i, unit)
    for name, param in trained.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], param), name


def test_hf_folder_of_another_shape_is_refused(tmp_path):
    torch.manual_seed(5)
    write_hf_folder(GPTNeoX(tiny_cfg(no_weight_tying=True, hidden_size=32, num_attention_heads=4), VOCAB),
                    tmp_path / "hf")
    from megatron.checkpointing.rank_files import CheckpointError
    with pytest.raises(CheckpointError, match="shape"):
        unit_materializer(meta_model(no_weight_tying=True), str(tmp_path / "hf"))


def _build_worker(rank: int, world_size: int, preset: str) -> dict:
    model = meta_model(no_weight_tying=True)
    topology = Topology.simulated([2, 2])
    groups = ProcessGroups(topology, ShardLayout.from_topology(topology, preset=preset), rank)
    comm = Communicator(groups)
    engine = ZeroTopoEngine(model, lm_loss, groups, comm, EngineSettings(optimizer=OPT, precision="fp32", accumulation_steps=1), device=torch.device("cpu"), materialize=unit_materializer(model))
    left = [name for unit in model.units() for name, _ in unit.named_parameters()]
    state = engine.full_state_dict()
    return {"params": state if rank == 0 else None, "left": left}


@pytest.mark.parametrize("preset", ["zero_topo", "stage3"])
def test_sharded_build_on_four_ranks_holds_the_reference_weights(tmp_path, preset):
    results = run_ranks("test_sharded_build:_build_worker", 4, tmp_path, preset=preset)
    assert all(r["left"] == [] for r in results)  # no full parameter survives the build
    torch.manual_seed(SEED)
    reference = GPTNeoX(tiny_cfg(no_weight_tying=True), VOCAB)
    for name, param in reference.named_parameters():
        assert torch.equal(results[0]["params"][name], param), name


def test_load_hf_on_simulated_ranks_starts_where_the_single_process_does(tmp_path, tiny_corpus, tiny_trained_step):
    from megatron.checkpointing.hf_io import export_hf
    hf = export_hf(tiny_trained_step, tmp_path / "hf")  # 3 trained steps (conftest)
    configs = {}
    for name, extra in (("single", {}), ("sharded", {"topology": {"simulate": [2, 2]},
                                                     "zero_optimization": {"preset": "zero_topo"}})):
        run_dir = tmp_path / name
        run_dir.mkdir()
        configs[name] = tiny_run_config(run_dir, tiny_corpus, train_iters=2, eval_iters=0, log_interval=1,
                                        load_hf=str(hf), train_micro_batch_size_per_gpu=2, **extra)
    runs = run_together(*(lambda c=c: run_deepy("train.py", str(c)) for c in configs.values()))
    losses = {}
    for name, done in zip(configs, runs):
        assert done.returncode == 0, done.stderr[-2000:]
        losses[name] = [json.loads(line)["train/lm_loss"]
                        for line in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()
                        if "train/lm_loss" in line]
    assert losses["sharded"] == pytest.approx(losses["single"], rel=1e-5, abs=1e-6)
