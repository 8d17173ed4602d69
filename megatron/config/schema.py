"""Typed configuration: one small dataclass per concern, every field documented where declared.

Field names are GPT-NeoX's (and DeepSpeed's for the nested dicts) so a NeoX YAML reads the same here.
Each field's ``help`` metadata is its single documentation; ``docs/config.md`` is generated from it.
Other metadata, read by validation and by the docs generator:
  key      the YAML spelling when it differs from the field name (dotted = inside a NeoX dict)
  choices  the accepted values; ``aliases`` maps other spellings to one of them
  ge/gt/le/lt  numeric bounds
Fields marked ``derived=True`` are computed once by validation and must not be set by users.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

INIT_METHODS = ("small_init", "wang_init", "normal", "scaled_normal", "xavier_normal", "xavier_uniform")


def doc(default, help: str, **meta):
    """A dataclass field with its documentation attached (mutable defaults wrapped)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ModelConfig:
    """The GPT-NeoX architecture (same semantics as Hugging Face GPTNeoXForCausalLM) and GPT-NeoX's
    Llama-family keys (RMSNorm, SwiGLU, grouped-query and sliding-window attention, bias flags).
    Sizes derived from these fields and the rules they must meet: megatron/config/model_shape.py."""
    num_layers: int = doc(2, "Number of transformer blocks.", ge=1)
    hidden_size: int = doc(128, "Model width.", ge=1)
    num_attention_heads: int = doc(4, "Attention heads; must divide hidden_size.", ge=1)
    seq_length: int = doc(128, "Training sequence length in tokens.", ge=1)
    max_position_embeddings: Optional[int] = doc(None, "Longest position the rotary cache covers; defaults to seq_length.", ge=1)
    intermediate_size: Optional[int] = doc(None, "GPT-NeoX's MLP size key; defaults to 4 x hidden_size. With activation gelu it is the inner width; with swiglu it is NOT: as GPT-NeoX, f = floor(2 x intermediate_size / 3), the fused up+gate projection has 2m x ceil(f / 2m) rows and the inner width is m x ceil(floor(f / 2) / m), m = mlp_multiple_of (Llama-7B: 32768 or 33024 -> 11008; for an inner width W give 3 x W). The two must agree (half the rows = the inner width), checked at load.", ge=1)
    mlp_multiple_of: int = doc(1, "Round the MLP widths up to a multiple of this (GPT-NeoX's rule, see intermediate_size).", ge=1)
    num_kv_heads: Optional[int] = doc(None, "Key/value heads: unset (= num_attention_heads) is multi-head attention; fewer is grouped-query attention (1: multi-query), each K/V head shared by num_attention_heads / num_kv_heads query heads. Must divide num_attention_heads. The fused QKV projection is then laid out [all Q | all K | all V] (GPT-NeoX's GQA layout); with multi-head attention per head [q | k | v] (HF GPTNeoX's).", ge=1)
    sliding_window_width: Optional[int] = doc(None, "Sliding-window attention (Mistral): each query sees itself and the sliding_window_width previous positions (GPT-NeoX's flash-attn window (w, 0)); in training, evaluation and generation with the KV cache. Unset: full causal attention.", ge=1)
    pos_emb: str = doc("rotary", "Position embedding; only 'rotary' is supported.", choices=("rotary",))
    rotary_pct: float = doc(1.0, "Fraction of each head dimension that rotary embedding rotates (0 < pct <= 1).", gt=0.0, le=1.0)
    rotary_emb_base: int = doc(10000, "Rotary frequency base (CodeLlama: 1000000).", ge=1)
    gpt_j_residual: bool = doc(False, "Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) (two norms), as NeoX-20B; false: sequential, x = x + attn(ln1(x)); x = x + mlp(ln2(x)) (Llama).")
    norm: str = doc("layernorm", "Normalisation of the two block norms and the final one: 'layernorm' (with bias) or 'rmsnorm' (no bias: scale x x / sqrt(mean(x^2) + eps), computed in fp32).", choices=("layernorm", "rmsnorm"))
    layernorm_epsilon: float = doc(1.0e-5, "LayerNorm epsilon (norm: layernorm).", gt=0.0)
    rms_norm_epsilon: float = doc(1.0e-8, "RMSNorm epsilon (norm: rmsnorm; GPT-NeoX's default 1e-8, Llama 1e-6, Llama-2/Mistral 1e-5).", gt=0.0)
    activation: str = doc("gelu", "MLP activation: 'gelu' (exact erf form, as HF's GPTNeoX) or 'swiglu' (gated: silu(gate) x up, the fused projection's rows [up | gate] as GPT-NeoX's linear1).", choices=("gelu", "swiglu"))
    use_bias_in_attn_linear: bool = doc(True, "Biases on the QKV and attention output projections (Llama: false).")
    use_bias_in_mlp: bool = doc(True, "Biases on the two MLP projections (llama/7B.yml: false; GPT-NeoX's llama2, codellama and mistral configs keep them).")
    no_weight_tying: bool = doc(False, "Untie the output layer from the input embedding (NeoX default: tied).")
    init_method: str = doc("small_init", "Init of input-side weights (NeoX's methods).", choices=INIT_METHODS)
    output_layer_init_method: str = doc("wang_init", "Init of output-side weights (attention dense, MLP out).", choices=INIT_METHODS)
    init_method_std: float = doc(0.02, "Std of the 'normal' init method.", gt=0.0)
    hidden_dropout: float = doc(0.0, "Dropout on residual branches.", ge=0.0, lt=1.0)
    attention_dropout: float = doc(0.0, "Dropout on attention probabilities.", ge=0.0, lt=1.0)
    checkpoint_activations: bool = doc(False, "Recompute each block's activations in backward (activation checkpointing).")
    checkpoint_num_layers: int = doc(1, "Blocks per checkpointed segment (only 1 is supported).", choices=(1,))
    recompute_granularity: str = doc(
        "full", "With checkpoint_activations, what a block recomputes in backward: 'full' (the whole block; "
        "keeps only its input) or 'selective' (keeps the outputs of its matmuls and of attention, recomputes "
        "the LayerNorms, rotary, GELU and copies between them: no matmul is recomputed). Megatron-LM's name.",
        choices=("full", "selective"))
    make_vocab_size_divisible_by: int = doc(128, "Pad the vocabulary to a multiple of this.", ge=1)
    padded_vocab_size: Optional[int] = doc(None, "Derived: tokenizer vocab padded to make_vocab_size_divisible_by (None until the vocabulary is known: train.py calls pad_vocab_size after loading the tokenizer).", derived=True)


@dataclass
class OptimizerConfig:
    """NeoX's `optimizer: {type, params: {...}}` plus its flat weight_decay / gradient_clipping."""
    type: str = doc("Adam", "Optimizer: Adam/AdamW (both are AdamW with decoupled decay here).",
                    key="optimizer.type", choices=("Adam", "AdamW"))
    lr: float = doc(6.0e-4, "Peak learning rate (optimizer.params.lr).", key="optimizer.params.lr", gt=0.0)
    betas: list = doc([0.9, 0.95], "Adam betas (optimizer.params.betas).", key="optimizer.params.betas")
    eps: float = doc(1.0e-8, "Adam epsilon (optimizer.params.eps).", key="optimizer.params.eps", gt=0.0)
    weight_decay: float = doc(0.01, "Decoupled weight decay; never applied to norms and biases.", ge=0.0)
    gradient_clipping: float = doc(1.0, "Global grad-norm clip; 0 disables.", ge=0.0)
    fused: bool = doc(True, "torch's fused AdamW kernel (torch.optim.AdamW(fused=True); the sharded engine calls the same kernel, torch._fused_adamw_, once per step on every unit's flat fp32 slices): one pass over the states instead of several, and no host sync to skip a step whose gradients are not finite. false: torch's for-loop AdamW (foreach=False), which rounds differently by an ulp here and there.",
                      key="optimizer.params.fused")


@dataclass
class LRScheduleConfig:
    """NeoX LR schedule: linear warmup, then decay to min_lr over lr_decay_iters."""
    lr_decay_style: str = doc("cosine", "Decay after warmup: cosine, linear or constant.", choices=("cosine", "linear", "constant"))
    lr_decay_iters: Optional[int] = doc(None, "Iterations the decay spans; defaults to train_iters (or lr_decay_fraction x train_iters).", ge=1)
    lr_decay_fraction: Optional[float] = doc(None, "Decay over this fraction of train_iters; sets lr_decay_iters (give one of the two).", gt=0.0, le=1.0)
    min_lr: float = doc(0.0, "Floor of the decay.", ge=0.0)
    warmup: float = doc(0.01, "Warmup as a fraction (0..1) of lr_decay_iters.", ge=0.0, le=1.0)
    warmup_iters: Optional[int] = doc(None, "Derived: warmup in iterations = round(warmup x lr_decay_iters).", derived=True)


@dataclass
class TokenizerConfig:
    """Which tokenizer and where it lives; the file itself is read by train.py, never by the config."""
    tokenizer_type: str = doc("HFTokenizer", "HFTokenizer (tokenizer.json), SPMTokenizer (sentencepiece) or CharLevelTokenizer.",
                              choices=("HFTokenizer", "SPMTokenizer", "CharLevelTokenizer"))
    vocab_file: Optional[str] = doc(None, "Tokenizer file (tokenizer.json or .model); unused for CharLevelTokenizer.")
    vocab_size: Optional[int] = doc(None, "Tokenizer vocabulary size when known without reading the file; otherwise read from the tokenizer at start-up.", ge=1)


@dataclass
class DataConfig:
    """Datasets (.bin/.idx prefixes), their blend and split."""
    data_path: Optional[str] = doc(None, "Prefix of a .bin/.idx pair (without extension), split by `split`.")
    train_data_paths: Optional[list] = doc(None, "Prefixes of training datasets, blended by train_data_weights.")
    valid_data_paths: Optional[list] = doc(None, "Prefixes of validation datasets.")
    test_data_paths: Optional[list] = doc(None, "Prefixes of test datasets.")
    train_data_weights: Optional[list] = doc(None, "Blend weights of train_data_paths (default: equal).")
    valid_data_weights: Optional[list] = doc(None, "Blend weights of valid_data_paths.")
    test_data_weights: Optional[list] = doc(None, "Blend weights of test_data_paths.")
    split: str = doc("969,30,1", "Train/valid/test split of data_path in proportions.")
    data_impl: str = doc("mmap", "Only 'mmap' (NeoX/Megatron .bin/.idx); NeoX's 'infer' means the same here.",
                         choices=("mmap",), aliases={"infer": "mmap"})
    seed: int = doc(1234, "Seed of the sample shuffle (and of model init).", ge=0)
    num_workers: int = doc(1, "DataLoader workers.", ge=0)
    build_demo_corpus: bool = doc(False, "Build the embedded demo corpus (Python stdlib sources), tokenizer and dataset if absent.")


@dataclass
class TrainingConfig:
    """Iterations, the batch triple and evaluation cadence."""
    train_iters: int = doc(100, "Optimizer steps to run.", ge=1)
    train_batch_size: Optional[int] = doc(None, "Global batch in samples (= micro x accumulation x data-parallel size).", ge=1)
    train_micro_batch_size_per_gpu: Optional[int] = doc(None, "Samples per rank per micro-step.", ge=1)
    gradient_accumulation_steps: Optional[int] = doc(None, "Micro-steps per optimizer step.", ge=1)
    eval_interval: int = doc(1000, "Evaluate every this many steps (and at the end).", ge=1)
    eval_iters: int = doc(10, "Validation micro-batches per evaluation (0 disables evaluation).", ge=0)
    device: str = doc("auto", "Compute device: auto (GPU when present), cpu or cuda.", choices=("auto", "cpu", "cuda"))
    max_consecutive_skipped_steps: int = doc(100, "Stop the run (exit code 2, no save) after this many steps in a row were skipped for a non-finite gradient; 0 = never stop.", ge=0)
    loss_spike_factor: float = doc(3.0, "Log (not stop) a loss above this many times its running mean; 0 = off.", ge=0.0)
    compile: bool = doc(False, "torch.compile each transformer block's forward (the engine's gather/release hooks stay outside the compiled region; the embedding, the head and the loss run eager). The first steps are slower while the blocks compile.",
                        key="compile")
    fused_cross_entropy: bool = doc(False, "Compute the training loss in the output head chunk by chunk (megatron/model/fused_cross_entropy.py): the [tokens, vocab] logits, their fp32 log-softmax and gradient (3 x tokens x vocab x 4 bytes, 9.9 GB per micro-batch at a 50k vocabulary and 16k tokens) are never held whole; the gradients of the head are made in forward. Same loss and gradients up to summation order. Evaluation and generation use the plain head.",
                                    key="fused_cross_entropy")


@dataclass
class PrecisionConfig:
    """Compute precision; NeoX writes bf16 as `bf16: {enabled}`, `precision: bfloat16` or `fp16: {type: bfloat16}`."""
    precision: str = doc("fp32", "Derived from fp16/bf16/precision keys: fp32, bfloat16 or fp16.",
                         choices=("fp32", "bfloat16", "fp16"),
                         aliases={"bf16": "bfloat16", "float32": "fp32", "float16": "fp16", "half": "fp16"})
    fp16: Optional[dict] = doc(None, "DeepSpeed fp16 block: enabled, loss_scale (0 = dynamic), loss_scale_window, hysteresis, min_loss_scale, initial_scale_power, type.")
    bf16: Optional[dict] = doc(None, "DeepSpeed bf16 block: {enabled: bool}.")
    fp32_allreduce: Optional[bool] = doc(None, "Run every gradient hop that crosses nodes in fp32: the step-boundary hops (cross-node reduce-scatter, replica all-reduce) and the micro-step reductions whose groups span nodes (stage 2/3, unquantized zeropp, w or g wider than a node); gradients are always accumulated over micro-batches in fp32 here. Unset: on when compute is bf16 or fp16, so sums over many nodes keep fp32 precision and cannot overflow fp16; false keeps them in the compute dtype (half the bytes).")
    communication_data_type: Optional[str] = doc(None, "DeepSpeed's key: the dtype every unquantized gradient reduction sums and sends in, the micro-step hops inside a node as well as those across nodes and the step boundary's (a quantized hop sums in fp32 either way). On NCCL/RCCL a reduce-scatter is a ring that rounds its partial sums to this dtype at every hop (docs/numerics.md). Unset: the compute dtype inside a node, and across nodes fp32 with fp32_allreduce; fp32 makes every sum fp32 (twice bf16's bytes); it cannot be combined with an fp32_allreduce that says otherwise.",
                                                 choices=("fp32", "fp16", "bf16"), aliases={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"})
    gradient_predivide_factor: Optional[float] = doc(None, "DeepSpeed's key: each rank's gradient is divided by this before it is summed across ranks, and by N / factor after (N ranks); here the division is folded into the backward, which runs on loss x loss_scale / (gradient_accumulation_steps x factor). Unset: N, so a rank's gradients have the size a single process's would for the same global batch and an fp16 run overflows (skips steps, lowers its loss scale) where a single process would; 1.0 is DeepSpeed's default (undivided gradients summed, N times larger on the wire). fp32 and bf16 results change only by rounding, and not at all when A x factor is a power of two. The single-process engine ignores it.", gt=0.0)


@dataclass
class LoggingConfig:
    """Where metrics go."""
    log_dir: str = doc("logs", "Folder for metrics.jsonl and tensorboard events (deepy also writes the run's config JSON here).")
    log_interval: int = doc(10, "Log every this many steps.", ge=1)
    use_wandb: bool = doc(False, "Log to Weights & Biases (WANDB_MODE=offline works).")
    wandb_project: str = doc("neox-topo", "wandb project.")
    wandb_group: Optional[str] = doc(None, "wandb group.")
    tensorboard_dir: Optional[str] = doc(None, "Write tensorboard events here when set.")
    peak_tflops_per_gpu: Optional[float] = doc(None, "The device's peak dense TFLOP/s in the run's precision, the denominator of runtime/mfu; None = from the GPU's name (megatron/logging/throughput.py: H100/H200, A100, MI250X GCD, MI300X...); MFU is not logged for a device the table lacks (CPU included).", gt=0.0)
    memory_report: bool = doc(False, "Every rank writes its measured peak memory per phase (build, load, step, save: peak RSS, and the device's peak allocation on a GPU) to <log_dir>/memory/rank_<r>.json (bench/memory.py reads them).")
    profile: bool = doc(False, "Profile the training steps profile_step_start .. profile_step_stop - 1 (torch.profiler): every rank writes each one's chrome trace to <log_dir>/profile/step_<n>_rank_<r>.json.gz (Perfetto, chrome://tracing) and rank 0 logs where the step's time went: milliseconds per kind of work (device kernels on a GPU, aten ops on a CPU; communication, matmul, attention, optimizer, ...), busy, idle, exposed communication and host syncs, to metrics.jsonl/tensorboard/wandb (`profile/...`) and the log; each rank's breakdown is beside its trace (step_<n>_rank_<r>.breakdown.json; megatron/logging/step_profile.py). GPT-NeoX's key (there for nsys).")
    profile_step_start: int = doc(10, "First profiled step (with profile).", ge=1)
    profile_step_stop: int = doc(12, "Profiling stops before this step (with profile).", ge=2)
    memory_report_allocator: bool = doc(False, "With memory_report on a CPU run: also each phase's peak of the bytes torch's CPU allocator holds (`allocator_peak`, the counterpart of the GPU's peak allocation; from torch.profiler's memory events, kept for the whole run: for runs of a few steps, as bench/memory.py --allocator). A GPU run records its own allocator's figure and ignores this.")


@dataclass
class CheckpointConfig:
    """Checkpoint cadence and locations."""
    save: Optional[str] = doc(None, "Checkpoint folder to save into.")
    load: Optional[str] = doc(None, "Checkpoint folder to resume from (its `latest`).")
    checkpoint_factor: Optional[int] = doc(None, "Save every this many steps.", ge=1)
    keep_last_n_checkpoints: Optional[int] = doc(None, "Keep only the newest n committed checkpoints.", ge=1)
    finetune: bool = doc(False, "Load weights only; reset iteration, optimizer and data position.")
    overwrite_checkpoints: bool = doc(False, "Let a run that does not resume from `save` (no `load`, or "
                                      "another folder) save into a `save` folder that already holds "
                                      "checkpoints: each step it saves replaces that step there, atomically. "
                                      "Without it such a run is refused at start-up.")
    load_hf: Optional[str] = doc(None, "Initialise the model from a Hugging Face GPTNeoXForCausalLM, LlamaForCausalLM "
                                 "or MistralForCausalLM folder (config.json + safetensors, e.g. made by "
                                 "tools/convert_to_hf.py); its shape must match the model keys (a Llama's "
                                 "intermediate_size I is ours 3 x I, its sliding_window W ours W - 1). Each rank "
                                 "reads only its slices.")


@dataclass
class ZeroConfig:
    """The ZeRO-topo engine: `zero_optimization` (DeepSpeed's keys plus ours)."""
    stage: int = doc(0, "DeepSpeed meaning: 0=(1,1,1) DDP, 1=(1,1,N), 2=(1,N,N), 3=(N,N,N).",
                     key="zero_optimization.stage", choices=(0, 1, 2, 3))
    preset: Optional[str] = doc(None, "hsdp | zeropp | zero_topo; overrides stage.",
                                key="zero_optimization.preset", choices=("hsdp", "zeropp", "zero_topo"))
    shard_factors: Optional[list] = doc(None, "Explicit [w, g, os] with w | g | os | N; overrides stage and preset.",
                                        key="zero_optimization.shard_factors")
    zero_hpz_partition_size: int = doc(1, "DeepSpeed ZeRO++ hpZ: with stage 3, a value > 1 selects the zeropp preset; it must equal the ranks per node.",
                                       key="zero_optimization.zero_hpz_partition_size", ge=1)
    zero_quantized_weights: bool = doc(False, "INT8 block-quantized weight gathers.", key="zero_optimization.zero_quantized_weights")
    zero_quantized_gradients: bool = doc(False, "INT4 block-quantized gradient reductions (all-to-all).", key="zero_optimization.zero_quantized_gradients")
    zero_quantized_refresh: bool = doc(False, "INT8 block-quantized refresh of the weight shards from the optimizer slices across nodes (the cross-group hop).",
                                       key="zero_optimization.zero_quantized_refresh")
    quantization_block_size: int = doc(256, "Elements per quantization block (one fp32 scale each); unit buffers are padded so no block straddles a shard. 256: INT4 gradients at 2048 cost 2.3% validation loss after 30 tiny-cpu steps, 0.3% at 256 (docs/quantization.md).",
                                       key="zero_optimization.quantization_block_size", ge=1)
    quantization_error_feedback: bool = doc(False, "Error feedback: keep the local residual of the quantized gradient hop across nodes (zero_topo's cross hop: S/g fp32 per rank; zeropp's second qgZ hop: S/R) and add it next step; hops inside a node keep none.",
                                            key="zero_optimization.quantization_error_feedback")
    weight_gather_bits: Optional[int] = doc(None, "Bits of the weight gathers (forward, backward, recompute, eval): 8 = INT8 blocks, 0 = compute dtype; None = 8 when zero_quantized_weights, else 0.",
                                            key="zero_optimization.weight_gather_bits", choices=(0, 8))
    grad_reduce_bits: Optional[int] = doc(None, "Bits of the micro-step gradient reductions (all-to-all hops): 4 = packed INT4, 8 = INT8, 0 = compute dtype; None = 4 when zero_quantized_gradients, else 0.",
                                          key="zero_optimization.grad_reduce_bits", choices=(0, 4, 8))
    cross_node_grad_bits: Optional[int] = doc(None, "Bits of the gradient hops across nodes (0, 4 or 8): the step-boundary reduction over the cross group, and ZeRO++ qgZ's second (rail) hop; with grad_reduce_bits for the hops inside a node this sets the widths per tier (8 in-node, 4 across nodes: grad_reduce_bits 8, cross_node_grad_bits 4). None = grad_reduce_bits (0 with cross_node_reduction all_reduce).",
                                              key="zero_optimization.cross_node_grad_bits", choices=(0, 4, 8))
    cross_node_reduction: str = doc("reduce_scatter", "How the step boundary sums each rank's 1/g gradient shard over the cross group (the os/g ranks at the same place on other nodes): reduce_scatter (ours) leaves each member its 1/os slice, sending (k-1)/k of the shard per rank in the boundary dtype (fp32 with fp32_allreduce, else the compute dtype) or as packed INT4/INT8 (cross_node_grad_bits); all_reduce (the paper's, arXiv 2501.04266) sums the whole shard on every member, unquantized in the boundary dtype, and keeps the same slice: twice the bytes across nodes, same training. all_reduce is never quantized: cross_node_grad_bits then defaults to 0 and a nonzero value is refused; it is refused for zeropp (no cross group) and with plan auto (the planner scores reduce_scatter), and changes nothing where the cross group has one rank (os = g).",
                                    key="zero_optimization.cross_node_reduction", choices=("reduce_scatter", "all_reduce"))
    refresh_bits: Optional[int] = doc(None, "Bits of the refresh's cross-group allgather of the updated slices: 8 = INT8, 0 = compute dtype; None = 8 when zero_quantized_weights or zero_quantized_refresh, else 0.",
                                      key="zero_optimization.refresh_bits", choices=(0, 8))
    zero_quantized_weights_delta: bool = doc(False, "The refresh's cross-node hop sends the change of the weights since the last refresh, as INT4 (weight_delta_bits) block codes, against the copy every member of the cross group already holds (its weight chunk); every member adds the same dequantized changes, so all hold the same weights bit for bit. Ladder layouts (zero_topo, custom factors) with os > g; refused with zeropp. The weights then lag the fp32 master by at most one delta quantization step (nothing accumulates: each change is taken against the weights held). docs/quantization.md says when to use it.",
                                             key="zero_optimization.zero_quantized_weights_delta")
    weight_delta_bits: Optional[int] = doc(None, "Bits of the weight deltas (4 or 8; 0 = off); None = 4 when zero_quantized_weights_delta, else 0.",
                                           key="zero_optimization.weight_delta_bits", choices=(0, 4, 8))
    weight_delta_full_refresh_interval: int = doc(0, "With weight deltas: every this many optimizer steps the refresh sends the weights themselves (at refresh_bits) instead of their change, so the weights equal the master's cast again; 0 = never (a load always rebuilds them in full, unless the checkpoint holds the weights a delta run saved).",
                                                  key="zero_optimization.weight_delta_full_refresh_interval", ge=0)
    zero_quantized_gradients_rotation: str = doc("none", "Rotate every quantized gradient block by the orthonormal Walsh-Hadamard matrix (a power-of-two quantization_block_size) before its first quantization and back after the last hop's sum, which spreads heavy-tailed blocks' outliers over the block (INT4 round-trip error 2-4x lower on Student-t gradients, docs/quantization.md); none: off. Same bytes on the wire; one rotation kernel per reduction each way.",
                                                   key="zero_optimization.zero_quantized_gradients_rotation", choices=("none", "hadamard"))
    quantization_impl: str = doc("auto", "Quantization kernels: auto (triton on GPUs, C++ on CPU), reference (plain torch), cpp or triton; one that cannot run here falls back to reference with a notice.",
                                 key="zero_optimization.quantization_impl", choices=("auto", "reference", "cpp", "triton"))
    prefetch_gathers: bool = doc(True, "Issue each unit's weight gather asynchronously one unit early (forward: while the previous unit computes; backward: while the next one does), so communication overlaps compute; at most two units are gathered at once. The bytes sent do not change. false: every gather waits in its own unit's hook.",
                                 key="zero_optimization.prefetch_gathers")
    overlap_comm: bool = doc(True, "Issue each unit's gradient reduction asynchronously as soon as the backward has produced it and finish it behind the backward of the units before it (DeepSpeed's overlap_comm); the backward ends by waiting for every reduction, so the optimizer and the next micro-batch see complete sums. Results are bit-identical to false (each reduction waited for at once) and the bytes sent do not change.",
                             key="zero_optimization.overlap_comm")
    reduce_bucket_size: int = doc(500_000_000, "Most elements one gradient-reduction collective carries (DeepSpeed's key): a larger unit is reduced in pieces, each the same columns of every member's share, cut at quantization blocks. Bucketed and unbucketed sums agree to fp32 rounding (gloo's summation order depends on the buffer size).",
                                  key="zero_optimization.reduce_bucket_size", ge=1)
    reduce_buckets_in_flight: int = doc(2, "With overlap_comm: most gradient pieces issued and not yet added to the accumulator (each holds its gradient and its hop buffers), like the gather prefetch's bound.",
                                        key="zero_optimization.reduce_buckets_in_flight", ge=1)
    plan: Optional[str] = doc(None, "auto: choose the shard factors (every nested [w, g, os], and ZeRO++) at start-up with the step-time model (megatron/analytic/planner.py; docs/time_model.md): the shortest predicted step whose memory peak fits plan_memory_per_device_gb, with the figures of topology.figure_set and topology.link_figures. Rank 0 logs the plan, why, and the figure set it used. Excludes stage, preset, shard_factors and zero_hpz_partition_size.",
                              key="zero_optimization.plan", choices=("auto",))
    plan_quantize: bool = doc(False, "With plan auto: the planner may also choose quantization bits per phase (none, INT4/INT8 at the step boundary only, or INT8 weights + INT4 gradients); false keeps the configured quantization.",
                              key="zero_optimization.plan_quantize")
    plan_memory_per_device_gb: Optional[float] = doc(None, "With plan auto: the memory budget of one device in GB (the memory model's peak must fit); None = the device's memory (64 on Frontier's GCDs, or the probe's).",
                                                     key="zero_optimization.plan_memory_per_device_gb", gt=0.0)
    resolved_factors: Optional[list] = doc(None, "Derived: the [w, g, os] this run uses (None with plan auto: chosen at start-up).",
                                           key="zero_optimization.resolved_factors", derived=True)
    resolved_preset: Optional[str] = doc(None, "Derived: the layout's name (megatron/topology/layout.py): stage0..stage3 (from stage), hsdp, zeropp, zero_topo, or custom for explicit shard_factors.",
                                          key="zero_optimization.resolved_preset", derived=True)


@dataclass
class TopologyConfig:
    """Where ranks sit: our key `topology` (tiers slowest first: nodes, GPUs, GCDs)."""
    preset: Optional[str] = doc(None, "frontier (nodes x 4 GPUs x 2 GCDs) | dgx (nodes x 8 GPUs) | sim (needs simulate); None = a single process unless simulate is set.",
                                key="topology.preset", choices=("frontier", "dgx", "sim"))
    simulate: Optional[list] = doc(None, "Simulated layout on this machine, fastest tier last, e.g. [2, 2, 2] = 2 nodes x 2 GPUs x 2 GCDs, or [2, 2].",
                                   key="topology.simulate")
    link_figures: Optional[str] = doc(None, "A link probe JSON (tools/probe_links.py, or written by hand: docs/time_model.md) whose per-tier bandwidths and latencies, per-(algorithm, group shape) curves, per-algorithm figures and device rates replace those of topology.figure_set in the step-time model (the planner of zero_optimization.plan auto, deepy --dry-run).",
                                      key="topology.link_figures")
    figure_set: str = doc("auto", "The step-time model's starting figures (docs/frontier-model.md): nominal (the topology's per-tier link figures and the device table), frontier-measured (published RCCL timings on Frontier with libfabric's rendezvous settings, megatron/analytic/figure_sets.py), frontier-eager (the same with libfabric's default eager protocol), or auto: frontier-measured on topology.preset frontier, nominal elsewhere. topology.link_figures applies on top.",
                          key="topology.figure_set", choices=("auto", "nominal", "frontier-measured", "frontier-eager"))
    layout: Optional[list] = doc(None, "Derived: ranks per tier, slowest first (simulate, or the preset over launcher.num_nodes / Slurm's node count, or under launcher slurm without a preset the allocation's nodes x tasks (or GPUs) per node); None for one process.",
                                 key="topology.layout", derived=True)
    world_size: Optional[int] = doc(None, "Derived: product of the layout (1 when none).",
                                      key="topology.world_size", derived=True)


@dataclass
class LauncherConfig:
    """How deepy.py starts the ranks."""
    launcher: str = doc("local", "local (this machine), slurm (srun) or hostfile (DeepSpeed's launcher; NeoX's 'pdsh' means the same).",
                        choices=("local", "slurm", "hostfile"), aliases={"pdsh": "hostfile"})
    hostfile: Optional[str] = doc(None, "Hostfile for launcher=hostfile (lines `host slots=N`).")
    include: Optional[str] = doc(None, "launcher=hostfile: DeepSpeed's --include NODE_SPEC (hosts/slots to use).")
    exclude: Optional[str] = doc(None, "launcher=hostfile: DeepSpeed's --exclude NODE_SPEC.")
    num_nodes: int = doc(-1, "Nodes to use (-1 = all); for topology presets also the node count of the layout.")
    num_gpus: Optional[int] = doc(None, "Ranks per node (must match the topology preset when one is set).", ge=1)
    master_addr: Optional[str] = doc(None, "Rendezvous host; default 127.0.0.1 (local), the first host of the allocation (slurm).")
    master_port: Optional[int] = doc(None, "Rendezvous port; default: a free port (local); $MASTER_PORT, else 20000 + the Slurm job id mod 10000 (slurm: jobs sharing a node get different ports unless their ids differ by a multiple of 10000; a requeued job keeps its port); 29500 (hostfile).", ge=1, le=65535)
    account: Optional[str] = doc(None, "launcher=slurm: srun --account.")
    comment: Optional[str] = doc(None, "launcher=slurm: srun --comment.")
    distributed_backend: str = doc("auto", "auto (nccl on GPUs, gloo on CPU), nccl or gloo.", choices=("auto", "nccl", "gloo"))
    distributed_timeout_minutes: float = doc(
        30, "How long a collective (and the rendezvous at start-up) may wait for a peer before the process group "
        "gives up, in minutes (Megatron-LM's name; 30 is DeepSpeed's default). Work that rank 0 does alone "
        "(the demo corpus, sample and blend indices, the data's digest) is not bounded by it: the other ranks "
        "wait for it on the rendezvous store for up to 24 h (docs/launch.md). A fraction is allowed (0.1 = 6 s, for tests).",
        gt=0.0)


@dataclass
class GenerationConfig:
    """Text generation by generate.py (GPT-NeoX's text-generation keys, same meanings and defaults)."""
    text_gen_type: Optional[str] = doc(None, "What generate.py does: unconditional (num_samples texts from the end-of-document token), input-file (one completion per prompt of sample_input_file) or interactive (prompts read from the terminal); unset is an error when generating, as in NeoX (configs/text_generation.yml sets it).",
                                       choices=("unconditional", "input-file", "interactive"))
    temperature: float = doc(0.0, "Sampling temperature: logits are divided by it before sampling; 0 = greedy decoding (the most likely token, top_k and top_p unused).", ge=0.0)
    top_k: int = doc(0, "Sample only among the k most likely tokens; 0 = no limit.", ge=0)
    top_p: float = doc(0.0, "Nucleus sampling: only among the most likely tokens whose probabilities add up to top_p (the first one always kept); 0 = no limit.", ge=0.0, le=1.0)
    maximum_tokens: int = doc(64, "Most tokens generated per prompt; generation also ends at the end-of-document token and at max_position_embeddings (the prompt counts).", ge=1)
    prompt_end: str = doc("\n", "What separates prompts in sample_input_file (a newline: one prompt per line); empty prompts are skipped.")
    sample_input_file: Optional[str] = doc(None, "input-file: the file of prompts (UTF-8).")
    sample_output_file: Optional[str] = doc(None, "Where results go, one JSON object per line (context, text, length, finished, message, duration_seconds, as NeoX); unset: <sample_input_file>.output.jsonl for input-file, <log_dir>/samples.jsonl otherwise.")
    num_samples: int = doc(1, "unconditional: how many texts to generate.", ge=1)
    recompute: bool = doc(False, "Recompute attention over the whole prefix for every new token instead of keeping a KV cache (slower, the same greedy tokens; a check, not a need here).")


@dataclass
class EvalConfig:
    """Evaluation by eval.py: loss and perplexity on the validation/test data, and lm-evaluation-harness tasks."""
    eval_tasks: Optional[list] = doc(None, "lm-evaluation-harness tasks to run (names such as lambada_openai, which need a network for their data sets, or paths of local task YAML files); unset: only the loss and perplexity on the data. Needs the `eval` extra (lm-eval).")
    eval_results_prefix: str = doc("", "Results go to <prefix>_eval_results_<time>.json; empty: <log_dir>/eval_results_<time>.json.")


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
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    config_files: list = doc([], "Derived: the YAML files merged, in order, as {path, text}.", derived=True)
    overrides: list = doc([], "Derived: the --set key=value overrides applied after merging, in order.", derived=True)
