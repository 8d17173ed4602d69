"""Hugging Face folders in and out: a checkpoint step of any layout <-> a `GPTNeoXForCausalLM` folder
(config.json + model.safetensors, plus tokenizer.json when the run used a HF tokenizer); a
Llama-shaped model exports to `LlamaForCausalLM` / `MistralForCausalLM` instead (hf_llama.py), with
tokenizer.model when the run used a sentencepiece one."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron.checkpointing.rank_files import CheckpointError, load_meta
from megatron.checkpointing.hf import (hf_config_dict, model_config_from_hf, to_hf_state_dict,
                                       from_hf_state_dict)
from megatron.checkpointing.hf_llama import HFLlamaError, llama_architecture, llama_config_dict, to_llama_state_dict
from megatron.checkpointing.reader import read_master_weights
from megatron.config import config_from_dict


def export_hf(step_dir: str | Path, output_dir: str | Path, dtype: torch.dtype = torch.float32,
              progress: bool = False) -> Path:
    """Write `output_dir` from checkpoint folder `step_dir` (a `global_stepN`); `progress`: show the
    reading of the master weights (bytes) on stderr (megatron/logging/progress.py)."""
    step_dir, out = Path(step_dir), Path(output_dir)
    if not (step_dir / "meta.json").is_file():
        raise CheckpointError(f"{step_dir} is not a committed checkpoint step (no meta.json); "
                              "pass a global_stepN folder")
    cfg = config_from_dict(load_meta(step_dir)["config"])
    vocab = cfg.model.padded_vocab_size
    params = read_master_weights(step_dir, progress=progress)
    llama = is_llama_shaped(cfg.model)
    to_hf, config = ((to_llama_state_dict, llama_config_dict(cfg.model, vocab)) if llama
                     else (to_hf_state_dict, hf_config_dict(cfg.model, vocab)))
    hf_sd = {k: v.to(dtype).contiguous() for k, v in to_hf(params, cfg.model).items()}
    out.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tokenizer_file = cfg.tokenizer.vocab_file
    if cfg.tokenizer.tokenizer_type == "SPMTokenizer" and tokenizer_file and Path(tokenizer_file).is_file():
        shutil.copyfile(tokenizer_file, out / "tokenizer.model")  # as Llama and Mistral ship theirs
    if cfg.tokenizer.tokenizer_type == "HFTokenizer" and tokenizer_file:
        if Path(tokenizer_file).is_file():
            shutil.copyfile(tokenizer_file, out / "tokenizer.json")
            config.update(_special_ids(Path(tokenizer_file)))
        else:
            warnings.warn(f"tokenizer {tokenizer_file} not found: exporting the model without it")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def is_llama_shaped(model_cfg) -> bool:
    """RMSNorm and SwiGLU: a Llama/Mistral export (which refuses, in one line, what it cannot hold);
    otherwise the GPTNeoX one (which refuses Llama-family parts)."""
    if model_cfg.norm != "rmsnorm" and model_cfg.activation != "swiglu":
        return False
    try:
        llama_architecture(model_cfg)
    except HFLlamaError as err:
        raise CheckpointError(f"cannot export to Hugging Face: {err}") from None
    return True


def _special_ids(tokenizer_json: Path) -> dict:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    eod = tok.token_to_id("<|endoftext|>")
    return {} if eod is None else {"bos_token_id": eod, "eos_token_id": eod}


def import_hf(folder: str | Path):
    """(ModelConfig, our state dict) from a HF GPT-NeoX folder with config.json + safetensors."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    model_cfg = model_config_from_hf(json.loads(config_path.read_text()))
    weights: dict[str, torch.Tensor] = {}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder} has no .safetensors weights")
    for shard in shards:
        weights.update(load_file(str(shard)))
    return model_cfg, from_hf_state_dict({k: v.float() for k, v in weights.items()}, model_cfg)
