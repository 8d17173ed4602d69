"""One process, one whole model, from a checkpoint saved under any engine layout: what generate.py
and eval.py run on.

`load` names a save folder (its `latest` is used, exactly as a resumed run picks it) or one
`global_stepN` folder. The master weights are read one parameter at a time through the layout-free
index (megatron/checkpointing/reader.py, the HF export's path), so a step written by 8 ZeRO-topo
ranks loads the same as one written by one process. The model is built from the run's config
files, as NeoX does; keys that change what the weights compute without changing their shapes must
agree with the checkpoint's own config, or the load is refused with the key named.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.build import derive_vocab
from megatron.checkpointing.folders import latest_step_dir
from megatron.checkpointing.rank_files import CheckpointError, load_meta
from megatron.checkpointing.folders import META
from megatron.checkpointing.param_slices import check_shapes
from megatron.checkpointing.reader import read_master_weights
from megatron.data import build_tokenizer
from megatron.engine import autocast_dtype_of
from megatron.model import GPTNeoX
from megatron.runtime import pick_device

# Model keys under which the same tensors compute something else: checked against the checkpoint.
# (Shapes are checked tensor by tensor; seq_length / max_position_embeddings may differ: rotary
# angles are computed, not stored.)
SAME_SHAPE_KEYS = ("rotary_pct", "rotary_emb_base", "gpt_j_residual", "layernorm_epsilon", "no_weight_tying",
                   "pos_emb", "norm", "activation")


@dataclass
class InferenceModel:
    """The loaded model (eval mode) with its tokenizer, device and compute precision."""
    cfg: object  # the run's config, padded_vocab_size derived from the tokenizer
    model: GPTNeoX
    tokenizer: object
    device: torch.device
    step_dir: Path
    iteration: int

    @property
    def compute_dtype(self) -> torch.dtype:
        return autocast_dtype_of(self.cfg.precision.precision) or torch.float32

    def autocast(self):
        """The training run's compute precision (SingleProcessEngine's autocast), so losses compare."""
        dtype = autocast_dtype_of(self.cfg.precision.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @property
    def max_positions(self) -> int:
        return int(self.model.rope_cos.shape[0])


def resolve_step_dir(load: str | None) -> Path:
    """The step folder `load` means; a one-line CheckpointError when there is none."""
    if not load:
        raise CheckpointError("no checkpoint to load: set `load` to a save folder or a global_stepN folder "
                              "(e.g. --set load=checkpoints/tiny-cpu)")
    folder = Path(load)
    if not folder.is_dir():
        raise CheckpointError(f"the load folder {folder} does not exist; set `load` to a save folder of a run")
    if (folder / META).is_file():
        return folder
    step_dir = latest_step_dir(folder)
    if step_dir is None:
        raise CheckpointError(f"the load folder {folder} holds no committed checkpoint (no global_stepN with "
                              f"{META}); point `load` at the `save` folder of a run that saved")
    return step_dir


def check_architecture(cfg, saved_config: dict, step_dir: Path) -> None:
    saved_model = saved_config.get("model", {})
    for key in SAME_SHAPE_KEYS:
        if key in saved_model and saved_model[key] != getattr(cfg.model, key):
            raise CheckpointError(f"checkpoint {step_dir} was trained with {key} {saved_model[key]!r} but the "
                                  f"config says {getattr(cfg.model, key)!r}; use the run's model config")


@torch.no_grad()
def load_inference_model(cfg, local_rank: int = 0, progress: bool = False) -> InferenceModel:
    """The model of `cfg.checkpoint.load` on the configured device, every weight from the checkpoint."""
    step_dir = resolve_step_dir(cfg.checkpoint.load)
    meta = load_meta(step_dir)
    tokenizer = build_tokenizer(cfg.tokenizer)
    cfg = derive_vocab(cfg, tokenizer.vocab_size)
    check_architecture(cfg, meta.get("config", {}), step_dir)
    device = pick_device(cfg.training.device, local_rank)
    with torch.device("meta"):  # no init draws: every weight comes from the checkpoint
        model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    model.to_empty(device=device)
    model.init_buffers()
    weights = read_master_weights(step_dir, progress=progress)
    params = dict(model.named_parameters())
    check_shapes({k: list(v.shape) for k, v in weights.items()}, {k: tuple(p.shape) for k, p in params.items()},
                 str(step_dir))
    for name, param in params.items():
        param.copy_(weights[name])
    return InferenceModel(cfg=cfg, model=model.eval(), tokenizer=tokenizer, device=device, step_dir=step_dir,
                          iteration=int(meta["iteration"]))


def only_rank_zero_works(script: str) -> int | None:
    """Generation and evaluation run on one process. Under a launch of several ranks (the training
    layout's configs), rank 0 works and the others have nothing to do: None for them (they exit 0),
    rank 0's local rank (its device) for it."""
    from megatron.runtime import launched_as

    rank, world_size, local_rank = launched_as()
    if rank != 0:
        return None
    if world_size > 1:
        print(f"notice: {script} runs on one process: rank 0 works, the other {world_size - 1} rank(s) exit "
              "(drop the layout configs to start only one)", file=sys.stderr, flush=True)
    return local_rank
