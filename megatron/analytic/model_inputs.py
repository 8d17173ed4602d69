"""From a validated config to the inputs of the analytic models (comm_model, memory_model).

The models take plain numbers (unit sizes, layout, factors, bits) so they stay independent of the
engine; this is the one place that reads those numbers off a ``NeoXConfig``, for the benchmarks and
``deepy.py --dry-run``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megatron.config import pad_vocab_size
from megatron.model.sizes import (autocast_copy_bytes, backward_activation_bytes, unit_flops_per_token,
                                  unit_parameter_counts)
from megatron.topology.layout import ShardLayout
from megatron.analytic.comm_model import CommSpec, transformer_block_units
from megatron.config.quant_spec import QuantSpec


def padded_vocab_of(cfg) -> Optional[int]:
    """The padded vocabulary: from the config when it knows the size (vocab_size, or a character
    tokenizer), else from the tokenizer file when it exists, else None (a dry run on a login node
    before the tokenizer was copied there)."""
    if cfg.model.padded_vocab_size is not None:
        return cfg.model.padded_vocab_size
    vocab_file = cfg.tokenizer.vocab_file
    if not vocab_file or not Path(vocab_file).is_file():
        return None
    from megatron.data import build_tokenizer
    return pad_vocab_size(build_tokenizer(cfg.tokenizer).vocab_size, cfg.model.make_vocab_size_divisible_by)


def compute_bytes_of(cfg) -> int:
    """Bytes of one element in the run's compute dtype (weights as gathered, activations)."""
    return 2 if cfg.precision.precision in ("bfloat16", "fp16") else 4


def reduce_bytes_of(cfg) -> Optional[int]:
    """Bytes of one element of precision.communication_data_type; None when unset."""
    dtype = cfg.precision.communication_data_type
    return None if dtype is None else 4 if dtype == "fp32" else 2


def comm_spec_from_config(cfg, padded_vocab: int, layout: Optional[ShardLayout] = None) -> CommSpec:
    """One optimizer step of the configured run on ``layout`` (the run's one ShardLayout; default:
    the validated config's, ``ShardLayout.from_config``)."""
    units = unit_parameter_counts(cfg.model, padded_vocab)
    layout = layout or ShardLayout.from_config(cfg)
    return CommSpec(units, layout, quant=QuantSpec.from_config(cfg.zero),
                    micro_batches=cfg.training.gradient_accumulation_steps or 1,
                    compute_bytes=compute_bytes_of(cfg),
                    fp32_allreduce=bool(cfg.precision.fp32_allreduce),
                    reduce_bytes=reduce_bytes_of(cfg),
                    cross_node_reduction=cfg.zero.cross_node_reduction,
                    reductions_in_flight=int(cfg.zero.reduce_buckets_in_flight) if cfg.zero.overlap_comm else 0,
                    reduce_bucket_elements=int(cfg.zero.reduce_bucket_size),
                    checkpointed_units=transformer_block_units(len(units)) if cfg.model.checkpoint_activations else ())


def _model_with(cfg, checkpoint_activations: Optional[bool]):
    """The configured model, its activation checkpointing overridden when given."""
    if checkpoint_activations is None:
        return cfg.model
    return dataclasses.replace(cfg.model, checkpoint_activations=checkpoint_activations)


def activations_from_config(cfg, padded_vocab: int, checkpoint_activations: Optional[bool] = None):
    """One micro-batch's activation bytes for the configured model, micro-batch, precision and loss,
    at the start of backward and in a block's backward (``model.sizes.backward_activation_bytes``);
    ``checkpoint_activations`` overrides the model's setting."""
    return backward_activation_bytes(_model_with(cfg, checkpoint_activations), padded_vocab,
                                     cfg.training.train_micro_batch_size_per_gpu or 1, compute_bytes_of(cfg),
                                     fused_cross_entropy=cfg.training.fused_cross_entropy)


def autocast_copies_from_config(cfg, padded_vocab: int, checkpoint_activations: Optional[bool] = None) -> int:
    """One process's autocast copies of its weights at the start of backward
    (``model.sizes.autocast_copy_bytes``; the memory model counts them only at world size 1);
    ``checkpoint_activations`` overrides the model's setting."""
    return autocast_copy_bytes(_model_with(cfg, checkpoint_activations), padded_vocab, compute_bytes_of(cfg),
                               cfg.training.fused_cross_entropy)


def step_work_from_config(cfg, padded_vocab: int):
    """The compute of one step of the configured run (``time_model.StepWork``)."""
    from megatron.analytic.time_model import StepWork
    tokens = (cfg.training.train_micro_batch_size_per_gpu or 1) * cfg.model.seq_length
    return StepWork(tokens, unit_flops_per_token(cfg.model, padded_vocab),
                    prefetch_gathers=bool(cfg.zero.prefetch_gathers), overlap_comm=bool(cfg.zero.overlap_comm),
                    recompute_matmuls=cfg.model.recompute_granularity == "full")


def backend_of(cfg) -> str:
    """The collectives' library the run will use: the configured one, else NCCL/RCCL unless the run
    is on the CPU (training.device cpu, or a simulated layout under device auto)."""
    backend = cfg.launcher.distributed_backend
    if backend != "auto":
        return backend
    on_cpu = cfg.training.device == "cpu" or (cfg.training.device == "auto" and bool(cfg.topology.simulate))
    return "gloo" if on_cpu else "nccl"


def figure_set_of(cfg) -> str:
    """The figure set the step-time model starts from: topology.figure_set, where auto is
    frontier-measured on a Frontier topology (published measurements beat nominal link speeds) and
    nominal elsewhere."""
    chosen = cfg.topology.figure_set
    if chosen != "auto":
        return chosen
    return "frontier-measured" if cfg.topology.preset == "frontier" else "nominal"


def hardware_from_config(cfg, world_size: Optional[int] = None):
    """The time model's figures for the configured run: the topology's tiers and device
    (``Hardware.from_topology``) under ``figure_set_of(cfg)``, overridden by ``topology.link_figures``
    (a probe file) when set."""
    from megatron.config import world_size_of
    from megatron.topology import Topology
    from megatron.analytic.hardware import Hardware
    topology = Topology.from_config(cfg, world_size or world_size_of(cfg))
    hw = Hardware.from_topology(topology, backend=backend_of(cfg), figures=figure_set_of(cfg))
    probe = cfg.topology.link_figures
    return hw.with_probe(probe, path=probe) if probe else hw


def figures_note(cfg) -> Optional[str]:
    """One line when the figures are a published set chosen for the user (auto on Frontier, no
    probe): what they are and how to replace them with the allocation's own."""
    if cfg.topology.link_figures or cfg.topology.figure_set != "auto" or figure_set_of(cfg) == "nominal":
        return None
    return ("figures: frontier-measured (a Frontier topology and no probe file: published RCCL timings on "
            "Frontier with libfabric's rendezvous settings, docs/frontier-model.md); measure this allocation "
            "with tools/probe_links.py and set topology.link_figures to use its own")
