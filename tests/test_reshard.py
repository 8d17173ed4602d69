"""Checkpoints across layouts through deepy.py: exact resume on the simulated 8-rank topology, and
the reshard chain zero_topo (8 ranks) -> zero3 (4 ranks) -> single process -> zero_topo (8 ranks);
for the NeoX-shaped tiny model and (slow) configs/tiny-llama-cpu.yml's Llama-shaped one.

The 8-rank runs cost ~15 s each on 2 cores, so both tests judge one set: the reference run, the
2-step run whose checkpoint starts the chain, and its resumption."""

import shutil

import pytest
import torch

from conftest import REPO, run_deepy, tiny_run_config, train_losses

# slow (~55 s of 8-rank runs): the default suite keeps an 8-rank bit-exact resume and the reshard of
# 8 zero3 ranks to 4 zero_topo ones (tests/test_checkpoint_reader.py), and resumes onto other factors
# and another world size (tests/test_beyond_int4.py)
pytestmark = pytest.mark.slow

SIM8 = [str(REPO / "configs/sim-2x2x2.yml"), str(REPO / "configs/zero_topo.yml")]
SIM4_ZERO3 = [str(REPO / "configs/sim-2x2.yml"), str(REPO / "configs/zero3.yml")]


def _run(cfg, *files_and_sets):
    result = run_deepy("train.py", str(cfg), *files_and_sets)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _llama_model_keys() -> dict:
    """The model keys of configs/tiny-llama-cpu.yml (the shipped Llama-shaped CPU model)."""
    import dataclasses
    import yaml
    from megatron.config.schema import ModelConfig
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    shipped = yaml.safe_load((REPO / "configs" / "tiny-llama-cpu.yml").read_text())
    return {k: v for k, v in shipped.items() if k in names}


MODELS = {"neox": {}, "llama": _llama_model_keys()}


def _config(tmp_path, name, corpus, model="neox", **overrides):
    folder = tmp_path / name
    folder.mkdir()
    base = dict(train_batch_size=16, train_micro_batch_size_per_gpu=2, lr_decay_iters=4, log_interval=1,
                eval_iters=0, eval_interval=100)
    return folder, tiny_run_config(folder, corpus, **{**base, **MODELS[model], **overrides})


@pytest.fixture(scope="module", params=["neox", pytest.param("llama", marks=pytest.mark.slow)])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def eight_rank_runs(tmp_path_factory, tiny_corpus, model):
    """zero_topo (2, 4, 8) on 8 ranks: 4 steps that never save (the reference), and a run that only
    knew about 2 steps, saved, then resumed to 4. Returns (reference folder, part folder, resumed run)."""
    tmp_path = tmp_path_factory.mktemp("reshard")
    full_dir, full = _config(tmp_path, "full", tiny_corpus, model, train_iters=4)
    _run(full, *SIM8)
    part_dir, part = _config(tmp_path, "part", tiny_corpus, model, train_iters=2, save=str(tmp_path / "part" / "ck"))
    _run(part, *SIM8)
    resumed = _run(part, *SIM8, "--set", "train_iters=4", "--set", f"load={part_dir / 'ck'}")
    return full_dir, part_dir, resumed


def test_exact_resume_on_eight_ranks(eight_rank_runs):
    full_dir, part_dir, resumed = eight_rank_runs
    assert "resumed from" in resumed.stdout
    reference, parts = train_losses(full_dir / "logs"), train_losses(part_dir / "logs")
    assert sorted(parts) == [1, 2, 3, 4]
    assert all(parts[i] == reference[i] for i in parts), (parts, reference)


def _state(step_dir):
    from megatron.checkpointing.param_slices import assemble_full_state
    return assemble_full_state(step_dir)


def _assert_same_state(a, b):
    assert a["step"] == b["step"]
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)


def test_reshard_chain(tmp_path, tiny_corpus, eight_rank_runs, model):
    full_dir, part_dir, _ = eight_rank_runs
    # zero_topo (2, 4, 8)'s step 2, in a folder of its own (the resumed run saved step 4 beside it);
    # the reference's steps 3-4 are what the end of the chain must train
    start = tmp_path / "start" / "global_step2"
    shutil.copytree(part_dir / "ck" / "global_step2", start)
    (start.parent / "latest").write_text("global_step2")

    b_dir, b = _config(tmp_path, "b", tiny_corpus, model, train_iters=2, save=str(tmp_path / "b" / "ck"), load=str(start.parent))
    _run(b, *SIM4_ZERO3)  # loads at step 2 and saves again under (4, 4, 4)
    _assert_same_state(_state(start), _state(b_dir / "ck" / "global_step2"))

    c_dir, c = _config(tmp_path, "c", tiny_corpus, model, train_iters=2, save=str(tmp_path / "c" / "ck"),
                       load=str(b_dir / "ck"))
    _run(c)  # single process
    _assert_same_state(_state(start), _state(c_dir / "ck" / "global_step2"))

    d_dir, d = _config(tmp_path, "d", tiny_corpus, model, train_iters=4, load=str(c_dir / "ck"))
    _run(d, *SIM8)  # back to zero_topo on 8 ranks; training continues
    reference, chained = train_losses(full_dir / "logs"), train_losses(d_dir / "logs")
    assert sorted(chained) == [3, 4]
    for it in (3, 4):
        assert abs(chained[it] - reference[it]) < 1e-5, (it, chained[it], reference[it])
