"""metrics.jsonl always; tensorboard events and an offline wandb run when enabled."""
import json
import os

from megatron.logging import MetricsWriter


def test_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(str(tmp_path / "logs"), enabled=True, tensorboard_dir=str(tmp_path / "tb"),
                           use_wandb=True, wandb_project="neox-topo-test", run_config={"a": 1})
    writer.log(1, {"train/lm_loss": 3.5, "train/learning_rate": 1e-3})
    writer.log(2, {"validation/lm_loss": 3.2})
    writer.close()
    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"iteration": 1, "train/lm_loss": 3.5, "train/learning_rate": 1e-3},
                     {"iteration": 2, "validation/lm_loss": 3.2}]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    runs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_other_ranks_write_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "logs"), enabled=False)
    writer.log(1, {"train/lm_loss": 1.0})
    writer.close()
    assert not (tmp_path / "logs").exists()
