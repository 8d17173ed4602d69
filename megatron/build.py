"""Build a training run from a validated config: runtime, tokenizer, data, model, engine, trainer.

The order matters in one place only: rank 0 builds the data caches (demo corpus, sample and blend
indices) while the other ranks wait for it (Runtime.on_rank_zero: on the rendezvous store, not in a
collective, so a build longer than distributed_timeout_minutes is fine), so no two processes write
the same file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.checkpointing.rank_files import CheckpointError
from megatron.checkpointing.hf_weights import HFWeights
from megatron.checkpointing.param_slices import check_shapes
from megatron.config import ConfigError, pad_vocab_size
from megatron.data import DataError, build_datasets, build_tokenizer
from megatron.data.demo_corpus import ensure_demo_data_from_config, unigram_entropy
from megatron.engine import SingleProcessEngine, training_loss_of
from megatron.engine.flat_unit import bits_checksum, build_slots
from megatron.loss_scale import LossScaleSettings
from megatron.logging.memory import PhasePeaks
from megatron.logging.metrics import log_print
from megatron.model import GPTNeoX, model_flops_per_token, num_parameters
from megatron.runtime import RankZeroError, Runtime, init_runtime
from megatron.training import Trainer

def _user_errors() -> tuple:
    from megatron.topology import TopologyError
    from megatron.engine.flat_unit import EngineError
    from megatron.numerics import NumericsError
    return (ConfigError, DataError, CheckpointError, TopologyError, EngineError, NumericsError, RankZeroError)


@contextlib.contextmanager
def user_errors():
    """Expected mistakes end the run with one line and exit code 2, never a traceback wall."""
    try:
        yield
    except _user_errors() as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@dataclass
class Run:
    cfg: object
    runtime: Runtime
    trainer: Trainer
    train_data: object
    memory: PhasePeaks

    def write_memory_report(self) -> None:
        """logging.memory_report: this rank's measured peaks per phase, to <log_dir>/memory/."""
        if self.cfg.logging.memory_report:
            self.memory.write(self.cfg.logging.log_dir, self.runtime.rank)

    def report(self) -> None:
        """Final numbers: losses against the data's unigram entropy, and bytes moved per tier."""
        if not self.runtime.is_main:
            return
        vocab = self.cfg.model.padded_vocab_size
        lines = []
        if self.trainer.numerics.last_loss is not None:
            lines.append(f"final train loss {self.trainer.numerics.last_loss:.4f}")
        if self.trainer.last_valid_loss is not None:
            lines.append(f"final validation loss {self.trainer.last_valid_loss:.4f}")
        entropy = unigram_entropy(self.train_data, vocab)
        if entropy is not None:
            lines.append(f"unigram entropy of the training data {entropy:.4f} nats/token")
        summary = self.trainer.comm_summary()
        if summary:
            lines.append(summary)
        losses = [line for line in lines if "loss" in line or "entropy" in line]
        log_print(" | ".join(losses) + "".join("\n" + line for line in lines if line not in losses))


def derive_vocab(cfg, tokenizer_vocab: int):
    """The config with padded_vocab_size from the tokenizer's own size (training, generation, eval)."""
    padded = pad_vocab_size(tokenizer_vocab, cfg.model.make_vocab_size_divisible_by)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, padded_vocab_size=padded))


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, folder: str) -> None:
    """One process: every parameter from the HF folder, read one tensor at a time (as the sharded build)."""
    hf = HFWeights(folder)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied output is listed (and read) as HF's embedding
    check_shapes({k: list(v) for k, v in hf.shapes().items()}, {k: tuple(v.shape) for k, v in params.items()}, folder)
    for name, param in params.items():
        param.copy_(hf.tensor(name))


def build_model(cfg, runtime: Runtime) -> GPTNeoX:
    """One process: the whole model, initialised (or loaded from load_hf), on its device. Several:
    the model on the meta device, no storage at all; the engine materialises it one unit at a time
    (``unit_materializer``), so no rank ever holds more than one full unit."""
    torch.manual_seed(cfg.data.seed)
    if runtime.distributed:
        with torch.device("meta"):
            return GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    model = GPTNeoX(cfg.model, cfg.model.padded_vocab_size)
    if cfg.checkpoint.load_hf:
        load_hf_weights(model, cfg.checkpoint.load_hf)
    return model.to(runtime.device)


def unit_materializer(model: GPTNeoX, hf_folder: str | None = None):
    """``materialize(i, unit, keep=None)`` for the engine: the unit's parameters on the CPU with
    NeoX's init, drawn in unit order from the seeded RNG (so the weights equal a whole model built
    on the CPU, the single-process reference), then overwritten from the HF folder when one is given
    (the draws still happen, so the RNG continues exactly as in the single-process run).

    ``keep`` (from the engine): the [lo, hi) ranges of the unit's flat buffer this rank keeps (its
    weight chunk and optimizer slice). With a HF folder only those elements are read (safetensors
    slices; each shard opened once per process); the rest keeps its init values, which the engine
    drops, so the ranks compare the checksum of the init draws (returned) instead of the unit's.
    Without ``keep`` every parameter is read whole (one process, tests)."""
    prefix = {id(module): name for name, module in model.named_modules()}
    hf = HFWeights(hf_folder) if hf_folder else None
    if hf is not None:
        check_shapes({k: list(v) for k, v in hf.shapes().items()},
                     {k: tuple(v.shape) for k, v in model.named_parameters(remove_duplicate=False)}, hf_folder)

    @torch.no_grad()
    def materialize(index: int, unit: torch.nn.Module, keep: list[tuple[int, int]] | None = None):
        unit.to_empty(device="cpu")
        named = [(f"{prefix[id(unit)]}.{name}", param) for name, param in unit.named_parameters()]
        model.init_parameters(named)
        if hf is None:
            return None
        if keep is None:
            for name, param in named:
                param.copy_(hf.tensor(name))
            return None
        drawn = bits_checksum([param for _name, param in named])
        names_by_id = {id(param): name for name, param in named}  # to_empty made new parameters
        for slot in build_slots(unit, names_by_id):  # where each parameter sits in the flat buffer
            flat = getattr(slot.module, slot.attr).view(-1)
            for lo, hi in _merged(keep):  # the optimizer slice lies inside the weight chunk: read once
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    flat[a - slot.offset: b - slot.offset] = hf.read(slot.name, a - slot.offset, b - slot.offset)
        return drawn
    return materialize


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [lo, hi) ranges with the overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif lo < hi:
            out.append((lo, hi))
    return out


def compile_blocks(model: GPTNeoX) -> None:
    """training.compile: each transformer block's ``forward`` compiled by torch.compile. Module hooks
    run in ``__call__``, outside ``forward``, so the engine's gathers, releases and gradient hooks
    stay eager; the engine's parameter views are graph inputs, so a new view per gather reuses the
    compiled graph (one graph for all blocks of one shape)."""
    for block in model.layers:
        block.forward = torch.compile(block.forward)


def build_engine(cfg, model: torch.nn.Module, runtime: Runtime, groups=None,
                 on_unit: Callable[[int], None] | None = None):
    """The single-process engine on one rank; the ZeRO-topo engine over the layout otherwise.
    ``groups``: the process groups, already built (else the engine builds them); ``on_unit(i)``:
    called as unit i starts being made real (the rehearsal times each unit's build)."""
    loss_fn = training_loss_of(cfg.training.fused_cross_entropy)
    if not runtime.distributed:
        return SingleProcessEngine(model, loss_fn, cfg.optimizer, cfg.precision.precision,
                           cfg.training.gradient_accumulation_steps, runtime.device,
                           loss_scaling=LossScaleSettings.from_config(cfg.precision))
    from megatron.engine.setup import engine_from_config
    materialize = unit_materializer(model, cfg.checkpoint.load_hf)
    if on_unit is not None:
        def materialize(index, unit, keep, inner=materialize):
            on_unit(index)
            return inner(index, unit, keep)
    engine = engine_from_config(cfg, model, loss_fn, runtime.world_size, device=runtime.device,
                                materialize=materialize, groups=groups)
    model.to_empty(device=runtime.device)  # what is left outside the units: the rotary tables
    model.init_buffers()
    return engine


def build_training(cfg) -> Run:
    runtime = init_runtime(cfg)
    if cfg.data.build_demo_corpus:
        runtime.on_rank_zero("build the demo corpus", lambda: ensure_demo_data_from_config(cfg))
    tokenizer = build_tokenizer(cfg.tokenizer)
    cfg = derive_vocab(cfg, tokenizer.vocab_size)
    tcfg = cfg.training
    global_batch = tcfg.train_batch_size  # micro x accumulation x ranks, derived once by validation
    num_valid = tcfg.eval_iters * tcfg.train_micro_batch_size_per_gpu * runtime.world_size
    # The tokenizer's own size, not the padded one: an id it cannot produce means other data.
    train_data, valid_data, _ = build_datasets(cfg, tokenizer.vocab_size,
                                               tcfg.train_iters * global_batch, num_valid,
                                               share=runtime.on_rank_zero)
    trace = cfg.logging.memory_report_allocator and runtime.device.type == "cpu"  # validation: implies memory_report
    memory = PhasePeaks(runtime.device, trace_allocator=trace)  # the baseline: interpreter, imports, data indices
    with memory.phase("build"):
        model = build_model(cfg, runtime)
        params = num_parameters(model)  # before the engine takes the parameters over
        engine = build_engine(cfg, model, runtime)
        if tcfg.compile:
            compile_blocks(model)
    if runtime.is_main:
        flops = model_flops_per_token(cfg.model, cfg.model.padded_vocab_size, cfg.model.seq_length)
        log_print(f"model: {params / 1e6:.2f}M parameters, {flops / 1e6:.1f} MFLOPs/token (train); "
                  f"{runtime.world_size} rank(s) on {runtime.device.type}; global batch {global_batch} "
                  f"= {tcfg.train_micro_batch_size_per_gpu} x {tcfg.gradient_accumulation_steps} accumulation "
                  f"x {runtime.world_size} ranks; precision {cfg.precision.precision}")
    trainer = Trainer(cfg, runtime, engine, train_data, valid_data, memory=memory)
    if cfg.checkpoint.load:
        with memory.phase("load"):
            trainer.resume(cfg.checkpoint.load)
    freeze_build_objects()
    return Run(cfg=cfg, runtime=runtime, trainer=trainer, train_data=train_data, memory=memory)


def freeze_build_objects() -> None:
    """Move every object alive after the build (modules, the config, the libraries' import-time
    objects: ~300,000 at start-up) out of the cyclic garbage collector's reach: they are never
    garbage, and scanning them in each collection the steps' allocations trigger cost the sharded
    engine 4.4 ms of its 22 per micro-step at 384 ranks (tools/rehearse.py). Reference counting still
    frees them; the steps' own objects are collected as usual."""
    gc.collect()
    gc.freeze()
