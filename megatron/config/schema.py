"""Typed configuration: one small dataclass per concern, every field documented where declared.

Field names are GPT-NeoX's (and DeepSpeed's for the nested dicts) so a NeoX YAML reads the same here.
Each field's ``help`` metadata is its single documentation; ``docs/config.md`` is generated from it.
Fields marked ``derived=True`` are computed once by validation and must not be set by users.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def doc(default, help: str, **meta):
    """A dataclass field with its documentation attached (mutable defaults wrapped)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ModelConfig:
    """The GPT-NeoX architecture (same semantics as Hugging Face GPTNeoXForCausalLM)."""
    num_layers: int = doc(2, "Number of transformer blocks.")
    hidden_size: int = doc(128, "Model width.")
    num_attention_heads: int = doc(4, "Attention heads; must divide hidden_size.")
    seq_length: int = doc(128, "Training sequence length in tokens.")
    max_position_embeddings: Optional[int] = doc(None, "Longest position the rotary cache covers; defaults to seq_length.")
    intermediate_size: Optional[int] = doc(None, "MLP inner width; defaults to 4 x hidden_size.")
    pos_emb: str = doc("rotary", "Position embedding; only 'rotary' is supported.")
    rotary_pct: float = doc(1.0, "Fraction of each head dimension that rotary embedding rotates (0 < pct <= 1).")
    rotary_emb_base: int = doc(10000, "Rotary frequency base.")
    gpt_j_residual: bool = doc(False, "Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) (two LayerNorms), as NeoX-20B.")
    norm: str = doc("layernorm", "Normalisation; only 'layernorm' is supported.")
    layernorm_epsilon: float = doc(1.0e-5, "LayerNorm epsilon.")
    activation: str = doc("gelu", "MLP activation: 'gelu' (exact erf form, as HF's GPTNeoX).")
    no_weight_tying: bool = doc(False, "Untie the output layer from the input embedding (NeoX default: tied).")
    init_method: str = doc("small_init", "Init of input-side weights: small_init, wang_init, normal, xavier_normal.")
    output_layer_init_method: str = doc("wang_init", "Init of output-side weights (attention dense, MLP out).")
    init_method_std: float = doc(0.02, "Std of the 'normal' init method.")
    hidden_dropout: float = doc(0.0, "Dropout on residual branches.")
    attention_dropout: float = doc(0.0, "Dropout on attention probabilities.")
    checkpoint_activations: bool = doc(False, "Recompute each block's activations in backward (activation checkpointing).")
    checkpoint_num_layers: int = doc(1, "Blocks per checkpointed segment (only 1 is supported).")
    make_vocab_size_divisible_by: int = doc(128, "Pad the vocabulary to a multiple of this.")
    padded_vocab_size: Optional[int] = doc(None, "Derived: tokenizer vocab padded to make_vocab_size_divisible_by.", derived=True)


@dataclass
class OptimizerConfig:
    """NeoX's `optimizer: {type, params: {...}}` plus its flat weight_decay / gradient_clipping."""
    type: str = doc("Adam", "Optimizer: Adam/AdamW (both are AdamW with decoupled decay here).")
    lr: float = doc(6.0e-4, "Peak learning rate (optimizer.params.lr).")
    betas: list = doc([0.9, 0.95], "Adam betas (optimizer.params.betas).")
    eps: float = doc(1.0e-8, "Adam epsilon (optimizer.params.eps).")
    weight_decay: float = doc(0.01, "Decoupled weight decay; never applied to norms and biases.")
    gradient_clipping: float = doc(1.0, "Global grad-norm clip; 0 disables.")


@dataclass
class LRScheduleConfig:
    """NeoX LR schedule: linear warmup, then decay to min_lr over lr_decay_iters."""
    lr_decay_style: str = doc("cosine", "Decay after warmup: cosine, linear or constant.")
    lr_decay_iters: Optional[int] = doc(None, "Iterations the decay spans; defaults to train_iters.")
    min_lr: float = doc(0.0, "Floor of the decay.")
    warmup: float = doc(0.01, "Warmup as a fraction (0..1) of lr_decay_iters.")
    warmup_iters: Optional[int] = doc(None, "Derived: warmup in iterations.", derived=True)


@dataclass
class TokenizerConfig:
    tokenizer_type: str = doc("HFTokenizer", "HFTokenizer (tokenizer.json), SPMTokenizer (sentencepiece) or CharLevelTokenizer.")
    vocab_file: Optional[str] = doc(None, "Tokenizer file (tokenizer.json or .model); unused for CharLevelTokenizer.")
    vocab_size: Optional[int] = doc(None, "Tokenizer vocabulary size when known without reading the file; otherwise read from the tokenizer at start-up.")


@dataclass
class DataConfig:
    data_path: Optional[str] = doc(None, "Prefix of a .bin/.idx pair (without extension), split by `split`.")
    train_data_paths: Optional[list] = doc(None, "Prefixes of training datasets, blended by train_data_weights.")
    valid_data_paths: Optional[list] = doc(None, "Prefixes of validation datasets.")
    test_data_paths: Optional[list] = doc(None, "Prefixes of test datasets.")
    train_data_weights: Optional[list] = doc(None, "Blend weights of train_data_paths (default: equal).")
    valid_data_weights: Optional[list] = doc(None, "Blend weights of valid_data_paths.")
    test_data_weights: Optional[list] = doc(None, "Blend weights of test_data_paths.")
    split: str = doc("969,30,1", "Train/valid/test split of data_path in proportions.")
    data_impl: str = doc("mmap", "Only 'mmap' (NeoX/Megatron .bin/.idx).")
    seed: int = doc(1234, "Seed of the sample shuffle (and of model init).")
    num_workers: int = doc(1, "DataLoader workers.")
    build_demo_corpus: bool = doc(False, "Build the embedded demo corpus (Python stdlib sources), tokenizer and dataset if absent.")


@dataclass
class TrainingConfig:
    train_iters: int = doc(100, "Optimizer steps to run.")
    train_batch_size: Optional[int] = doc(None, "Global batch in samples (= micro x accumulation x data-parallel size).")
    train_micro_batch_size_per_gpu: Optional[int] = doc(None, "Samples per rank per micro-step.")
    gradient_accumulation_steps: Optional[int] = doc(None, "Micro-steps per optimizer step.")
    eval_interval: int = doc(1000, "Evaluate every this many steps (and at the end).")
    eval_iters: int = doc(10, "Validation micro-batches per evaluation.")
    device: str = doc("auto", "Compute device: auto (GPU when present), cpu or cuda.")


@dataclass
class PrecisionConfig:
    """Compute precision; NeoX writes bf16 as `bf16: {enabled}`, `precision: bfloat16` or `fp16: {type: bfloat16}`."""
    precision: str = doc("fp32", "Derived from fp16/bf16/precision keys: fp32, bfloat16 or fp16.")
    fp16: Optional[dict] = doc(None, "DeepSpeed fp16 block: enabled, loss_scale (0 = dynamic), loss_scale_window, hysteresis, min_loss_scale, type.")
    bf16: Optional[dict] = doc(None, "DeepSpeed bf16 block: {enabled: bool}.")
    fp32_allreduce: bool = doc(False, "Reduce gradients in fp32 (gradients are always accumulated in fp32 here).")


@dataclass
class LoggingConfig:
    log_dir: str = doc("logs", "Folder for metrics.jsonl and tensorboard events.")
    log_interval: int = doc(10, "Log every this many steps.")
    use_wandb: bool = doc(False, "Log to Weights & Biases (WANDB_MODE=offline works).")
    wandb_project: str = doc("neox-topo", "wandb project.")
    wandb_group: Optional[str] = doc(None, "wandb group.")
    tensorboard_dir: Optional[str] = doc(None, "Write tensorboard events here when set.")


@dataclass
class CheckpointConfig:
    save: Optional[str] = doc(None, "Checkpoint folder to save into.")
    load: Optional[str] = doc(None, "Checkpoint folder to resume from (its `latest`).")
    checkpoint_factor: Optional[int] = doc(None, "Save every this many steps.")
    keep_last_n_checkpoints: Optional[int] = doc(None, "Keep only the newest n committed checkpoints.")
    finetune: bool = doc(False, "Load weights only; reset iteration, optimizer and data position.")


@dataclass
class ZeroConfig:
    """The ZeRO-topo engine: `zero_optimization` (DeepSpeed's keys plus ours)."""
    stage: int = doc(0, "DeepSpeed meaning: 0=(1,1,1) DDP, 1=(1,1,N), 2=(1,N,N), 3=(N,N,N).")
    preset: Optional[str] = doc(None, "hsdp | zeropp | zero_topo; overrides stage.")
    shard_factors: Optional[list] = doc(None, "Explicit [w, g, os] with w | g | os | N; overrides stage and preset.")
    zero_quantized_weights: bool = doc(False, "INT8 block-quantized weight gathers.")
    zero_quantized_gradients: bool = doc(False, "INT4 block-quantized gradient reductions (all-to-all).")
    resolved_factors: Optional[list] = doc(None, "Derived: the [w, g, os] this run uses.", derived=True)


@dataclass
class TopologyConfig:
    """Where ranks sit: our key `topology` (tiers fastest to slowest)."""
    preset: Optional[str] = doc(None, "frontier | dgx | sim; None = a single process.")
    simulate: Optional[list] = doc(None, "Simulated layout, fastest tier last, e.g. [2, 2, 2] = 2 nodes x 2 GPUs x 2 GCDs.")
    world_size: Optional[int] = doc(None, "Derived: product of the layout (1 when none).", derived=True)


@dataclass
class LauncherConfig:
    launcher: str = doc("local", "local (this machine), slurm (srun) or hostfile.")
    hostfile: Optional[str] = doc(None, "Hostfile for launcher=hostfile.")
    num_nodes: int = doc(-1, "Nodes to use (-1 = all).")
    num_gpus: Optional[int] = doc(None, "Ranks per node.")
    master_port: int = doc(29500, "Rendezvous port.")
    distributed_backend: str = doc("auto", "auto (nccl on GPUs, gloo on CPU), nccl or gloo.")


@dataclass
class NeoXConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    config_files: list = doc([], "Derived: the YAML files merged, in order, with their text.", derived=True)
