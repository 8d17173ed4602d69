"""Every config key we accept, and what happens to it: HONOURED, NOOP or REFUSED.

- HONOURED keys land in a typed field. Most come straight from the schema (a field's YAML key is its
  name, or its ``key`` metadata); a few are NeoX aliases of another key (``lr``, ``batch_size``...);
  ``optimizer``, ``optimizer.params``, ``zero_optimization`` and ``topology`` are containers whose
  entries are keys of their own (dotted: ``zero_optimization.stage``).
- NOOP keys are accepted and ignored, with a one-line notice naming the reason.
- REFUSED keys are accepted only at a neutral value (``model_parallel_size: 1``); any other value
  is an error that says what we do instead.
Derived schema fields are refused too: validation computes them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from megatron.config.schema import NeoXConfig

NEOX_KEYS_FILE = Path(__file__).with_name("neox_keys.txt")
CONTAINERS = ("optimizer", "optimizer.params", "zero_optimization", "topology")


class Status(str, Enum):
    HONOURED = "honoured"
    NOOP = "no-op"
    REFUSED = "refused"


Neutral = Callable[[Any, Mapping[str, Any]], bool]


@dataclass(frozen=True)
class KeyRule:
    """How one YAML key (dotted inside NeoX dicts) is treated."""
    key: str
    status: Status
    target: Optional[str] = None      # HONOURED: "group.field" of NeoXConfig
    alias_of: Optional[str] = None    # HONOURED alias: the canonical YAML key it stands for
    container: bool = False           # HONOURED dict whose entries are keys of their own
    reason: str = ""                  # NOOP: why it is ignored; REFUSED: what to do instead
    accepts: str = ""                 # REFUSED: the neutral value(s), in words
    neutral: Optional[Neutral] = None  # REFUSED: True for a value that asks for nothing we lack


# -- neutral-value predicates (value, flat leaves of the whole config) -> bool ------------------------

def _one_of(*values) -> Neutral:
    return lambda v, _: v is None or any(v == x and type(v) is type(x) for x in values)


def _unset(v, _) -> bool:
    return v is None or v == "" or v == [] or v == {}


def _false(v, _) -> bool:
    return v is None or v is False


def _disabled(v, _) -> bool:
    return v is None or v is False or (isinstance(v, dict) and not v.get("enabled", False))


def _true(v, _) -> bool:
    return v is None or v is True


def _dense_attention(v, leaves) -> bool:
    """[[["global"], n], ...]: every layer type global or flash (both are our SDPA attention)."""
    if v is None:
        return True
    try:
        return all(t in ("global", "flash") for types, _count in v for t in types)
    except (TypeError, ValueError):
        return False


def _equals_key(other: str, default: int) -> Neutral:
    return lambda v, leaves: v is None or v == leaves.get(other, default)


def _offload_off(v, _) -> bool:
    return v is None or (isinstance(v, dict) and str(v.get("device", "none")).lower() == "none")


# -- NOOP keys, grouped by the reason printed once per run ----------------------------------------------

_NOOP: dict[str, tuple[str, ...]] = {
    "kernel fusion flags are ignored; torch picks the kernels (SDPA attention)": (
        "scaled_upper_triang_masked_softmax_fusion", "scaled_masked_softmax_fusion", "bias_gelu_fusion",
        "bias_dropout_fusion", "rope_fusion", "layernorm_fusion", "rmsnorm_fusion", "use_flashattn_swiglu",
        "mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion"),
    "numerics are fixed here (softmax, loss and query-key scaling in fp32 by SDPA/torch)": (
        "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "fp16_lm_cross_entropy"),
    "apply only to architectures we do not build (ScaleNorm, RPE, learned, gMLP, Mamba, RWKV)": (
        "scalenorm_epsilon", "rpe_num_buckets", "rpe_max_distance", "opt_pos_emb_offset",
        "gmlp_attn_dim", "mamba_selective_fp32_params", "mamba_use_bias_in_conv", "mamba_use_bias_in_linears",
        "dim_att", "head_size", "ffn_dim", "sparsity_config", "sparse_attention", "param_sharing_style",
        "rotary_save_freqs_buffer"),
    "only meaningful with tensor/pipeline/expert parallelism, which ZeRO-topo replaces": (
        "pipe_partition_method", "sequence_parallel", "output_layer_parallelism", "expert_interval",
        "use_cpu_initialization", "lazy_mpu_init"),
    "ZeRO-topo gathers and reduces one unit at a time (prefetch: zero_optimization.prefetch_gathers; overlap: zero_optimization.overlap_comm, reduce_bucket_size, reduce_buckets_in_flight); DeepSpeed's other ZeRO tuning knobs do not apply": (
        "zero_reduce_scatter", "zero_contiguous_gradients", "zero_reduce_bucket_size", "zero_allgather_bucket_size",
        "zero_optimization.allgather_partitions", "zero_optimization.allgather_bucket_size",
        "zero_optimization.reduce_scatter",
        "zero_optimization.contiguous_gradients", "zero_optimization.load_from_fp32_weights",
        "zero_optimization.elastic_checkpoint", "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save", "zero_optimization.round_robin_gradients",
        "zero_optimization.ignore_unused_parameters", "zero_optimization.legacy_stage1",
        "zero_optimization.zero_quantized_nontrainable_weights", "zero_optimization.memory_efficient_linear",
        "zero_optimization.use_multi_rank_bucket_allreduce", "zero_optimization.pipeline_loading_checkpoint",
        "zero_optimization.override_module_apply", "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.cpu_offload_use_pin_memory", "zero_optimization.mics_hierarchical_params_gather",
        "prescale_gradients", "sparse_gradients"),
    "activation checkpointing here is torch's, one transformer block per segment": (
        "partition_activations", "synchronize_each_layer", "contiguous_checkpointing", "checkpoint_in_cpu",
        "profile_backward", "deepspeed_activation_checkpointing", "activation_checkpointing"),
    "loss scaling is configured inside the fp16 block (loss_scale, loss_scale_window, hysteresis, min_loss_scale)": (
        "hysteresis", "dynamic_loss_scale", "loss_scale", "loss_scale_window", "min_scale"),
    "NeoX clips with gradient_clipping (clip_grad is Megatron's unused spelling)": ("clip_grad",),
    "DeepSpeed itself is not used: the ZeRO-topo engine and our launcher replace it": (
        "deepspeed", "deepscale", "deepscale_config", "deepspeed_slurm", "deepspeed_extra_args", "dump_state",
        "flops_profiler", "autotuning", "data_types", "checkpoint", "force_multi", "no_ssh_check",
        "detect_nvlink_pairs", "tensorboard", "wandb", "csv_monitor", "curriculum_seqlen"),
    "extra diagnostics and profilers are not implemented (loss, lr, grad norm and per-tier bytes are always logged)": (
        "log_grad_pct_zeros", "log_param_norm", "log_grad_norm", "log_optimizer_states", "log_gradient_noise_scale",
        "gradient_noise_scale_n_batches", "gradient_noise_scale_cpu_offload", "memory_profiling",
        "memory_profiling_path", "steps_per_print",
        "wall_clock_breakdown", "comms_logger", "char_level_ppl"),
    "wandb needs only use_wandb, wandb_project and wandb_group here": (
        "wandb_team", "wandb_host", "wandb_init_all_ranks"),
    "Comet is not supported (use wandb or tensorboard_dir)": (
        "comet_workspace", "comet_project", "comet_experiment_name", "comet_tags", "comet_others"),
    "set at run time by NeoX itself, not by users": (
        "git_hash", "tensorboard_writer", "comet_experiment", "adlr_autoresume_object", "iteration", "do_train",
        "do_valid", "do_test", "tokenizer", "user_script"),
    "the rank count comes from `topology`, never from the GPUs of the launching host": ("global_num_gpus",),
    "cluster auto-resume, ONNX and exit-interval hooks are not implemented": (
        "adlr_autoresume", "adlr_autoresume_interval", "onnx_safe", "exit_interval"),
    "data loading always reads the .bin/.idx pair directly (packed samples, shared file system)": (
        "use_shared_fs", "mmap_warmup", "allow_chopped", "short_seq_prob", "weighted_sampler_alpha"),
    "preference/reward training (DPO, KTO, RM) is not supported; pretraining ignores these": (
        "dpo_fp32", "dpo_reference_free", "dpo_beta", "kto_fp32", "kto_desirable_weight", "kto_undesirable_weight",
        "kto_beta", "z_loss"),
    "muP is not supported (use_mup is refused); its scales are ignored": (
        "coord_check", "save_base_shapes", "base_shapes_file", "mup_init_scale", "mup_attn_temp", "mup_output_temp",
        "mup_embedding_mult", "mup_rp_embedding_mult", "mup_width_scale"),
    "generate.py writes texts only (no logits) and has no precompute mode": (
        "precompute_model_name", "return_logits"),
    "mixture of experts is not supported (moe_num_experts is refused above 1); MoE settings are ignored": (
        "moe_top_k", "use_tutel", "moe_loss_coeff", "moe_train_capacity_factor", "moe_eval_capacity_factor",
        "moe_min_capacity", "moe_token_dropping", "create_moe_param_group", "moe_use_residual", "moe_type",
        "moe_glu", "moe_lbl_in_fp32", "moe_jitter_eps"),
    "checkpoints always hold weights, optimizer and RNG state, saved at checkpoint_factor multiples and the last step": (
        "no_save_optim", "no_save_rng", "no_load_rng", "extra_save_iters", "checkpoint_validation_with_forward_pass",
        "s3_chunk_size"),
    "the LR schedule always comes from the config (checkpoints store only the iteration)": ("override_lr_scheduler",),
    "GPT-NeoX reads it nowhere either: its RMSNorm has no bias and its LayerNorm always has one (so here)": (
        "use_bias_in_norms",),
    "HFTokenizer reads its merges from tokenizer.json": ("merge_file",),
    "both Adam and AdamW use decoupled weight decay here": ("optimizer.params.adam_w_mode", "optimizer.params.torch_adam"),
}

# -- REFUSED keys: (key, neutral predicate, accepted value in words, what to do instead) -------------------

_TP = "tensor parallelism is not supported; ZeRO-topo shards instead — set model_parallel_size: 1"
_REFUSED: tuple[tuple[str, Neutral, str, str], ...] = (
    ("model_parallel_size", _one_of(1), "1", _TP),
    ("pipe_parallel_size", _one_of(0, 1), "0 or 1",
     "pipeline parallelism is not supported; ZeRO-topo shards instead — set pipe_parallel_size: 1 (or 0)"),
    ("is_pipe_parallel", _false, "false", "pipeline parallelism is not supported; remove is_pipe_parallel"),
    ("world_size", _unset, "unset", "the world size is derived from `topology` (simulate or preset); remove world_size"),
    ("moe_num_experts", _one_of(1), "1", "mixture of experts is not supported; set moe_num_experts: 1"),
    ("moe_expert_parallel_size", _one_of(1), "1", "expert parallelism is not supported; set moe_expert_parallel_size: 1"),
    ("enable_expert_tensor_parallelism", _false, "false", "expert tensor parallelism is not supported; remove it"),
    ("attention_config", _dense_attention, "global/flash layers only",
     "only dense causal attention (global or flash layers, sliding_window_width for Mistral) is built here; "
     "Mamba, RWKV, sparse and local layer types are other model families — use [[['global'], num_layers]] or remove attention_config"),
    ("use_qk_layernorm", _false, "false", "QK LayerNorm is not part of GPT-NeoX; remove it"),
    ("gpt_j_tied", _false, "false",
     "a tied LayerNorm in the parallel residual is not supported (NeoX-20B and Pythia use two); remove gpt_j_tied"),
    ("expansion_factor", _unset, "unset", "set intermediate_size directly instead (default 4 x hidden_size)"),
    ("num_unique_layers", _equals_key("num_layers", 2), "unset or num_layers", "parameter sharing across layers is not supported"),
    ("soft_prompt_tuning", _disabled, "unset or enabled: false", "soft prompt tuning is not supported"),
    ("use_bnb_optimizer", _false, "false", "bitsandbytes optimizers are not supported; the engine keeps fp32 Adam slices"),
    ("use_checkpoint_lr_scheduler", _false, "false", "the LR schedule always comes from the config; remove it"),
    ("use_comet", _false, "false", "Comet is not supported; use use_wandb or tensorboard_dir"),
    ("local_rank", _unset, "unset", "the launcher sets LOCAL_RANK; remove it from the config"),
    ("rank", _unset, "unset", "the launcher sets RANK; remove it from the config"),
    ("deepspeed_mpi", _false, "false", "MPI launch is not supported; use launcher: local, slurm or hostfile"),
    ("autotuning_run", _unset, "unset", "DeepSpeed autotuning is not supported; remove it"),
    ("eod_mask_loss", _false, "false", "the loss covers every token, end-of-document ones included; remove eod_mask_loss"),
    ("weight_by_num_documents", _false, "false", "set train_data_weights explicitly instead"),
    ("pack_impl", _one_of("packed"), "packed", "samples are always packed across documents; remove pack_impl"),
    ("dataset_impl", _one_of("gpt2"), "gpt2", "only GPT-style pretraining datasets are supported"),
    ("train_impl", _one_of("normal"), "normal", "only plain language-model pretraining is supported (no DPO/KTO/RM)"),
    ("s3_path", _unset, "unset", "checkpoints are written to `save` only; copy them to S3 yourself"),
    ("checkpoint_scale", _one_of("linear"), "linear", "log-spaced checkpoints are not supported; set checkpoint_factor"),
    ("no_load_optim", _false, "false", "to load weights only, set finetune: true"),
    ("train_epochs", _unset, "unset", "set train_iters instead"),
    ("use_mup", _false, "false", "muP is not supported; remove use_mup"),
    ("scheduler", _unset, "unset", "the LR schedule comes from lr_decay_style, warmup, min_lr and lr_decay_iters; remove `scheduler`"),
    ("amp", _disabled, "unset or enabled: false", "Apex AMP is not used; set precision (or bf16/fp16 blocks) instead"),
    ("curriculum_learning", _disabled, "unset or enabled: false", "curriculum learning is not supported"),
    ("data_efficiency", _disabled, "unset or enabled: false", "DeepSpeed data efficiency is not supported"),
    ("elasticity", _disabled, "unset or enabled: false", "elastic training is not supported; resume from a checkpoint with any layout instead"),
    ("compression_training", _unset, "unset", "compression training is not supported"),
    ("zero_optimization.cpu_offload", _false, "false", "CPU offload is not supported; shard wider (stage 3 or a larger shard_factors os) instead"),
    ("zero_optimization.cpu_offload_params", _false, "false", "CPU offload is not supported; shard wider instead"),
    ("zero_optimization.offload_optimizer", _offload_off, "unset or device: none", "CPU/NVMe offload is not supported; shard wider instead"),
    ("zero_optimization.offload_param", _offload_off, "unset or device: none", "CPU/NVMe offload is not supported; shard wider instead"),
    ("zero_optimization.mics_shard_size", _one_of(-1, 0), "unset, -1 or 0",
     "MiCS is not supported; zero_optimization.preset hsdp or shard_factors gives the same node-sharded layout"),
    ("optimizer.params.amsgrad", _false, "false", "AMSGrad is not supported"),
    ("optimizer.params.bias_correction", _true, "true", "Adam always uses bias correction here"),
    ("optimizer.params.freeze_step", _unset, "unset", "1-bit Adam is not supported; use type: Adam"),
)

_PAIRED_DATA = tuple(
    f"{prefix}{split}_{kind}data_paths"
    for split in ("train", "valid", "test")
    for prefix, kind in (("", "label_"), ("", "reward_"), ("pos_", ""), ("neg_", ""), ("pos_", "label_"), ("neg_", "label_")))
_REFUSED += tuple(
    (key, _unset, "unset", "label, reward and preference datasets are not supported (pretraining on data_path or train_data_paths only)")
    for key in _PAIRED_DATA)

# -- NeoX aliases: another spelling of an honoured key --------------------------------------------------

_ALIASES = {
    "lr": "optimizer.params.lr",
    "batch_size": "train_micro_batch_size_per_gpu",
    "zero_stage": "zero_optimization.stage",
    "optimizer_type": "optimizer.type",
    "optimizer.params.weight_decay": "weight_decay",
}


def _schema_rules() -> dict[str, KeyRule]:
    """HONOURED rules for every user field of the schema; REFUSED rules for the derived ones."""
    rules: dict[str, KeyRule] = {}
    for group in fields(NeoXConfig):
        if group.name in ("config_files", "overrides"):
            rules[group.name] = KeyRule(group.name, Status.REFUSED, neutral=_unset, accepts="unset",
                                        reason="is written by deepy (the merged files and --set overrides); remove it")
            continue
        for f in fields(group.default_factory()):
            key = f.metadata.get("key", f.name)
            if f.metadata.get("derived"):
                rules[key] = KeyRule(key, Status.REFUSED, neutral=_unset, accepts="unset",
                                     reason=f"is derived by validation ({f.metadata['help']}); remove it")
            else:
                rules[key] = KeyRule(key, Status.HONOURED, target=f"{group.name}.{f.name}")
    return rules


def build_registry() -> Mapping[str, KeyRule]:
    """All rules by YAML key; fails loudly (at import) if one key is declared twice."""
    rules = _schema_rules()

    def add(rule: KeyRule) -> None:
        if rule.key in rules:
            raise RuntimeError(f"config registry declares {rule.key!r} twice")
        rules[rule.key] = rule

    for key in CONTAINERS:
        add(KeyRule(key, Status.HONOURED, container=True))
    for key, canonical in _ALIASES.items():
        add(KeyRule(key, Status.HONOURED, target=rules[canonical].target, alias_of=canonical))
    for reason, keys in _NOOP.items():
        for key in keys:
            add(KeyRule(key, Status.NOOP, reason=reason))
    for key, neutral, accepts, advice in _REFUSED:
        add(KeyRule(key, Status.REFUSED, neutral=neutral, accepts=accepts, reason=advice))
    return MappingProxyType(rules)


REGISTRY: Mapping[str, KeyRule] = build_registry()


def neox_key_names(path: Path = NEOX_KEYS_FILE) -> list[str]:
    """The GPT-NeoX key names shipped in neox_keys.txt (comments and blank lines skipped)."""
    names = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(line)
    return names


def rule_for(key: str) -> Optional[KeyRule]:
    return REGISTRY.get(key)
