"""Cross-field validation and the values derived once: layout and world size, batch triple, padded
vocabulary, warmup iterations, precision, defaults that depend on other keys, and ZeRO factors.

Nothing here reads a data, tokenizer or checkpoint file; the only outside input is the Slurm
allocation (megatron/topology/allocation.py): the node count of a topology preset (launcher.num_nodes,
else Slurm's variables, else 1) and, under launcher slurm, its task and GPU counts; only when those
and the preset leave `device: auto` open is torch asked how many GPUs it sees (`uses_gpus`).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional

from megatron.config.errors import ConfigError, config_error
from megatron.config.routing import GROUPS, Routed, yaml_key_of
from megatron.config.model_shape import shape_problem
from megatron.config.schema import NeoXConfig
from megatron.topology.allocation import (NODE_VARS, SlurmAllocation, allocation_from_env, layout_mismatch,
                                          run_uses_gpus, visible_gpu_count)
from megatron.topology.layout import SINGLE_PROCESS, ZEROPP, ShardLayout
from megatron.config.quant_spec import QuantSpec
from megatron.topology.errors import TopologyError

CHAR_LEVEL_VOCAB = 512
PRESET_NODE_SHAPE = {"frontier": [4, 2], "dgx": [8]}  # ranks per node, slowest tier first


def pad_vocab_size(vocab_size: int, divisor: int) -> int:
    """The vocabulary rounded up to a multiple of `divisor` (NeoX's padding, model parallel size 1)."""
    if vocab_size < 1 or divisor < 1:
        raise ConfigError(f"cannot pad a vocabulary of {vocab_size} to a multiple of {divisor}; both must be >= 1")
    return -(-vocab_size // divisor) * divisor


def world_size_of(cfg: NeoXConfig) -> int:
    """Ranks of the configured layout: the derived topology.world_size, else the layout's product, else 1."""
    topo = cfg.topology
    if topo.world_size:
        return int(topo.world_size)
    layout = topo.layout or topo.simulate
    return math.prod(int(n) for n in layout) if layout else 1


class _Context:
    """Names each typed field by the YAML key the user wrote (or would write) and its origin."""

    def __init__(self, routed: Routed):
        self.routed = routed

    def key(self, target: str) -> str:
        return self.routed.keys.get(target) or yaml_key_of(target)

    def given(self, target: str) -> bool:
        return target in self.routed.values

    def error(self, target: str, problem: str, fix: Optional[str] = None) -> ConfigError:
        return config_error(self.key(target), problem, self.routed.origin(target), fix)


def build_config(routed: Routed, env: Mapping[str, str]) -> NeoXConfig:
    """A NeoXConfig from routed values, validated, with every derived field filled in."""
    groups = {name: factory() for name, factory in GROUPS.items()}
    for target, value in routed.values.items():
        group, name = target.split(".")
        setattr(groups[group], name, value)
    cfg = NeoXConfig(**groups)
    ctx = _Context(routed)
    for step in (_model, _optimizer, _lr_schedule, _vocab, _data, _precision, _layout, _batch, _zero, _launcher,
                 _generation, _logging):
        step(cfg, ctx, env)
    return cfg


def _model(cfg: NeoXConfig, ctx: _Context, env) -> None:
    m = cfg.model
    problem = shape_problem(m)  # the shape's rules, written once (the model checks the same function)
    if problem is not None:
        raise ctx.error(f"model.{problem.field}", problem.problem, problem.fix)
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.intermediate_size is None:
        m.intermediate_size = 4 * m.hidden_size
    if m.recompute_granularity == "selective":
        if cfg.training.compile:
            # Selective checkpointing runs the block under a dispatch mode, and torch.compile does
            # not trace under one: the blocks would run eager without a word.
            raise ctx.error("model.recompute_granularity", "'selective' and compile: true do not go together "
                            "(torch.compile does not trace under selective checkpointing: the blocks would run eager)",
                            "keep one: compile, or recompute_granularity: selective")


def _optimizer(cfg: NeoXConfig, ctx: _Context, env) -> None:
    betas = cfg.optimizer.betas
    if (len(betas) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in betas)
            or not all(0.0 <= b < 1.0 for b in betas)):
        raise ctx.error("optimizer.betas", f"expected two numbers in [0, 1), got {betas}", "e.g. betas: [0.9, 0.95]")
    cfg.optimizer.betas = [float(b) for b in betas]


def _lr_schedule(cfg: NeoXConfig, ctx: _Context, env) -> None:
    s, iters = cfg.lr_schedule, cfg.training.train_iters
    if s.lr_decay_fraction is not None:
        if s.lr_decay_iters is not None:
            raise ctx.error("lr_schedule.lr_decay_fraction", "and lr_decay_iters are both set", "keep one of the two")
        s.lr_decay_iters = max(1, round(s.lr_decay_fraction * iters))
    if s.lr_decay_iters is None:
        s.lr_decay_iters = iters
    s.warmup_iters = math.floor(s.warmup * s.lr_decay_iters + 0.5)  # round half up
    if s.min_lr > cfg.optimizer.lr:
        raise ctx.error("lr_schedule.min_lr", f"{s.min_lr} is above the peak lr {cfg.optimizer.lr}", "lower min_lr or raise lr")


def _vocab(cfg: NeoXConfig, ctx: _Context, env) -> None:
    tok = cfg.tokenizer
    known = tok.vocab_size
    if tok.tokenizer_type == "CharLevelTokenizer":
        if known is not None and known != CHAR_LEVEL_VOCAB:
            raise ctx.error("tokenizer.vocab_size", f"{known} disagrees with CharLevelTokenizer's {CHAR_LEVEL_VOCAB}",
                            "remove vocab_size")
        known = CHAR_LEVEL_VOCAB
    if known is not None:
        cfg.model.padded_vocab_size = pad_vocab_size(known, cfg.model.make_vocab_size_divisible_by)


def _data(cfg: NeoXConfig, ctx: _Context, env) -> None:
    d = cfg.data
    parts = [p.strip() for p in d.split.split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(x < 0 for x in shares) or sum(shares) <= 0:
        raise ctx.error("data.split", f"{d.split!r} is not 1 to 3 comma-separated non-negative proportions",
                        "e.g. split: '969,30,1'")
    if d.data_path is not None and d.train_data_paths:
        raise ctx.error("data.train_data_paths", "and data_path are both set", "use data_path (split by `split`) or the three *_data_paths lists")
    for kind in ("train", "valid", "test"):
        paths, weights = getattr(d, f"{kind}_data_paths"), getattr(d, f"{kind}_data_weights")
        if paths is not None and not all(isinstance(p, str) for p in paths):
            raise ctx.error(f"data.{kind}_data_paths", f"expected a list of path prefixes, got {paths}")
        if weights is None:
            continue
        if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0 for w in weights):
            raise ctx.error(f"data.{kind}_data_weights", f"expected non-negative numbers, got {weights}")
        if paths is None or len(weights) != len(paths):
            raise ctx.error(f"data.{kind}_data_weights", f"has {len(weights)} weights for {len(paths or [])} paths",
                            f"give one weight per entry of {kind}_data_paths")


def _precision(cfg: NeoXConfig, ctx: _Context, env) -> None:
    """NeoX writes bf16 three ways; fp16 enabled means fp16 unless its type is bfloat16."""
    p = cfg.precision
    claims: list[tuple[str, str]] = []
    if p.fp16 and p.fp16.get("enabled", False):
        kind = str(p.fp16.get("type", "fp16")).lower()
        if kind not in ("fp16", "float16", "half", "bfloat16", "bf16"):
            raise ctx.error("precision.fp16", f"type {p.fp16.get('type')!r} is not supported", "use type: bfloat16 or leave it out")
        claims.append(("fp16.enabled", "bfloat16" if kind in ("bfloat16", "bf16") else "fp16"))
    if p.bf16 and p.bf16.get("enabled", False):
        claims.append(("bf16.enabled", "bfloat16"))
    if ctx.given("precision.precision"):
        claims.append(("precision", p.precision))
    wanted = {value for _, value in claims}
    if len(wanted) > 1:
        said = ", ".join(f"{key} asks for {value}" for key, value in claims)
        raise ctx.error("precision.precision", f"the precision keys disagree: {said}", "keep one way of saying it")
    p.precision = wanted.pop() if wanted else "fp32"
    if p.communication_data_type is not None:  # every gradient sum in one dtype: fp32_allreduce follows it
        if p.fp32_allreduce is not None and p.fp32_allreduce != (p.communication_data_type == "fp32"):
            raise ctx.error("precision.communication_data_type",
                            f"{p.communication_data_type} contradicts fp32_allreduce: {str(p.fp32_allreduce).lower()}",
                            "keep one of the two")
        p.fp32_allreduce = p.communication_data_type == "fp32"
    if p.fp32_allreduce is None:  # fp32 compute: moot; bf16/fp16: sums over 48 nodes need fp32
        p.fp32_allreduce = p.precision != "fp32"
    if p.fp16:  # loss scaling's keys, checked here so a bad value stops deepy, not the ranks
        from megatron.loss_scale import LossScaleSettings
        try:
            LossScaleSettings.from_config(p)
        except (TypeError, ValueError) as err:
            raise ctx.error("precision.fp16", str(err).removeprefix("fp16 block: "), "see docs/numerics.md") from None


def _positive_ints(value, count: tuple[int, ...]) -> bool:
    return (isinstance(value, list) and len(value) in count
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value))


def preset_nodes(cfg: NeoXConfig, env: Mapping[str, str]) -> int:
    """Nodes of a topology preset: launcher.num_nodes, else the Slurm allocation, else 1."""
    if cfg.launcher.num_nodes > 0:
        return cfg.launcher.num_nodes
    for var in NODE_VARS:
        if env.get(var):
            try:
                return max(1, int(env[var]))
            except ValueError:
                raise ConfigError(f"environment variable {var}={env[var]!r} is not a node count; unset it or set num_nodes") from None
    return 1


def _layout(cfg: NeoXConfig, ctx: _Context, env) -> None:
    t = cfg.topology
    if t.simulate is not None:
        if not _positive_ints(t.simulate, (2, 3)):
            raise ctx.error("topology.simulate", f"expected [nodes, gpus] or [nodes, gpus, gcds] of positive integers, got {t.simulate}",
                            "e.g. simulate: [2, 2, 2]")
        t.layout = list(t.simulate)
    elif t.preset in PRESET_NODE_SHAPE:
        per_node = PRESET_NODE_SHAPE[t.preset]
        if cfg.launcher.num_gpus is not None and cfg.launcher.num_gpus != math.prod(per_node):
            raise ctx.error("launcher.num_gpus", f"{cfg.launcher.num_gpus} disagrees with topology preset {t.preset} "
                            f"({math.prod(per_node)} ranks per node)", "remove num_gpus or the preset")
        t.layout = [preset_nodes(cfg, env)] + per_node
    elif t.preset == "sim":
        raise ctx.error("topology.preset", "'sim' needs topology.simulate", "add simulate: [nodes, gpus, gcds], e.g. [2, 2, 2]")
    elif cfg.launcher.launcher == "slurm" and slurm_allocation(env) is not None:
        t.layout = _allocation_layout(cfg, ctx, slurm_allocation(env), env)
    else:
        t.layout = None
    if cfg.launcher.num_nodes == 0 or cfg.launcher.num_nodes < -1:
        raise ctx.error("launcher.num_nodes", f"must be -1 (all) or a positive count, got {cfg.launcher.num_nodes}")
    t.world_size = math.prod(t.layout) if t.layout else 1


def slurm_allocation(env: Mapping[str, str]) -> Optional[SlurmAllocation]:
    """The allocation this process runs in (None outside Slurm); unreadable counts are config errors."""
    try:
        return allocation_from_env(env)
    except TopologyError as err:
        raise ConfigError(str(err)) from None


def uses_gpus(cfg: NeoXConfig, env: Mapping[str, str], visible_gpus: Callable[[], int] = visible_gpu_count) -> bool:
    """Whether the run has one rank per GPU, which srun binds (megatron/topology/allocation.py:
    run_uses_gpus): `device`, else under launcher slurm the allocation's GPUs, else the preset,
    else the GPUs torch sees."""
    alloc = slurm_allocation(env) if cfg.launcher.launcher == "slurm" else None
    return run_uses_gpus(cfg.training.device, cfg.topology.preset, alloc, visible_gpus)


def _allocation_layout(cfg: NeoXConfig, ctx: _Context, alloc: SlurmAllocation, env: Mapping[str, str]) -> list:
    """launcher slurm without a topology: two tiers, nodes x ranks per node, from the allocation."""
    gpus = uses_gpus(cfg, env)
    per_node = alloc.ranks_per_node(uses_gpus=gpus)
    if per_node is None:
        raise ctx.error("topology.preset", f"is unset and the allocation does not fix the ranks per node "
                        f"({alloc.describe(uses_gpus=gpus)})",
                        "set a topology preset (frontier, dgx) or submit with --ntasks-per-node")
    nodes = cfg.launcher.num_nodes if cfg.launcher.num_nodes > 0 else (alloc.nodes or 1)
    return [nodes, per_node]


def _batch(cfg: NeoXConfig, ctx: _Context, env) -> None:
    """NeoX/DeepSpeed's rule: any two of the triple give the third; all three must multiply out."""
    tr, dp = cfg.training, cfg.topology.world_size
    batch, micro, accum = tr.train_batch_size, tr.train_micro_batch_size_per_gpu, tr.gradient_accumulation_steps
    where = f"data-parallel size {dp}"
    if batch is not None and micro is not None and accum is not None:
        if batch != micro * accum * dp:
            raise ctx.error("training.train_batch_size", f"{batch} != train_micro_batch_size_per_gpu {micro} x "
                            f"gradient_accumulation_steps {accum} x {where} = {micro * accum * dp}", "give two of the three and let the third be derived")
    elif batch is not None and micro is not None:
        if batch % (micro * dp):
            raise ctx.error("training.train_batch_size", f"{batch} is not a multiple of train_micro_batch_size_per_gpu {micro} x {where}",
                            "make the global batch a multiple of micro x ranks")
        accum = batch // (micro * dp)
    elif batch is not None and accum is not None:
        if batch % (accum * dp):
            raise ctx.error("training.train_batch_size", f"{batch} is not a multiple of gradient_accumulation_steps {accum} x {where}")
        micro = batch // (accum * dp)
    elif micro is not None:
        accum = accum or 1
        batch = micro * accum * dp
    elif batch is not None:
        if batch % dp:
            raise ctx.error("training.train_batch_size", f"{batch} is not a multiple of the {where}")
        micro, accum = batch // dp, 1
    else:
        # NeoX would stop here; an overlay config (local_setup.yml) loaded alone deserves a result.
        micro, accum = 1, accum or 1
        batch = micro * accum * dp
        ctx.routed.messages.append("no train_batch_size or train_micro_batch_size_per_gpu given: "
                                   "using train_micro_batch_size_per_gpu 1")
    tr.train_batch_size, tr.train_micro_batch_size_per_gpu, tr.gradient_accumulation_steps = batch, micro, accum


def _zero(cfg: NeoXConfig, ctx: _Context, env) -> None:
    """resolved_factors / resolved_preset from the one ShardLayout (megatron/topology/layout.py)."""
    z = cfg.zero
    tiers = cfg.topology.layout or SINGLE_PROCESS
    hpz = z.zero_hpz_partition_size
    if z.plan == "auto":
        chosen = [target for target in ("zero.stage", "zero.preset", "zero.shard_factors", "zero.zero_hpz_partition_size")
                  if ctx.given(target)]
        if chosen:
            raise ctx.error(chosen[0], "is set together with plan: auto, which chooses the layout itself",
                            "remove one of the two")
        if z.cross_node_reduction == "all_reduce":
            raise ctx.error("zero.cross_node_reduction", "all_reduce is set together with plan: auto, whose step-time "
                            "model scores the reduce-scatter only", "remove one of the two")
        z.resolved_factors, z.resolved_preset = None, None  # megatron.analytic.planner.planned_config
        return
    for target in ("zero.plan_quantize", "zero.plan_memory_per_device_gb"):
        if ctx.given(target):
            raise ctx.error(target, "only applies with plan: auto", "set zero_optimization.plan: auto or remove it")
    if hpz > 1:
        if z.shard_factors is None and z.preset is None and z.stage != 3:
            raise ctx.error("zero.zero_hpz_partition_size", f"{hpz} needs stage 3 (ZeRO++ hpZ)", "set stage: 3 or preset: zeropp")
        if z.shard_factors is None and z.preset is None:
            z.preset = ZEROPP
    try:
        layout = ShardLayout.resolve(tiers, z.stage, z.preset, z.shard_factors)
    except TopologyError as err:
        target = "zero.shard_factors" if z.shard_factors is not None else "zero.preset" if z.preset else "zero.stage"
        raise ctx.error(target, str(err), "pick factors that nest, or a preset") from None
    if hpz > 1 and hpz != layout.ranks_per_node:
        raise ctx.error("zero.zero_hpz_partition_size", f"{hpz} is not the ranks per node ({layout.ranks_per_node}) of this layout",
                        f"set it to {layout.ranks_per_node} or use preset: zeropp")
    z.resolved_factors, z.resolved_preset = list(layout.factors.as_tuple()), layout.preset
    _cross_node_reduction(z, ctx, layout)
    if layout.hpz and (z.zero_quantized_weights_delta or z.weight_delta_bits):
        target = "zero.zero_quantized_weights_delta" if z.zero_quantized_weights_delta else "zero.weight_delta_bits"
        raise ctx.error(target, "sends the refresh's weight changes across the cross group, which zeropp (hpZ) "
                        "does not have", "use preset zero_topo (or any [w, g, os]), or turn weight deltas off")
    QuantSpec.from_config(z)  # bits, block and rotation checked together, here (QuantSpecError: one line)


def _cross_node_reduction(z, ctx: _Context, layout: ShardLayout) -> None:
    """all_reduce (the paper's step-boundary hop) is an unquantized all-reduce: the cross hop's bits
    default to 0 there (not to grad_reduce_bits, which zero_quantized_gradients makes 4: a user who
    asks for the paper's hop and INT4 micro-step hops means exactly that) and a nonzero value is
    refused; zeropp has no cross group for it to act on."""
    if z.cross_node_reduction != "all_reduce":
        return
    if layout.hpz:
        raise ctx.error("zero.cross_node_reduction", "all_reduce needs a cross group, which zeropp (hpZ) does not have",
                        "use preset zero_topo (or any [w, g, os]) or cross_node_reduction: reduce_scatter")
    if z.cross_node_grad_bits is None:
        z.cross_node_grad_bits = 0
    elif z.cross_node_grad_bits:
        raise ctx.error("zero.cross_node_grad_bits", f"{z.cross_node_grad_bits} quantizes the cross hop, but "
                        "cross_node_reduction all_reduce sends it unquantized",
                        "set cross_node_grad_bits: 0 (or leave it unset), or use cross_node_reduction: reduce_scatter")


def _launcher(cfg: NeoXConfig, ctx: _Context, env) -> None:
    la = cfg.launcher
    if la.launcher == "hostfile" and not la.hostfile:
        raise ctx.error("launcher.launcher", "hostfile needs `hostfile: PATH` (lines `host slots=N`)", "set hostfile")


def _generation(cfg: NeoXConfig, ctx: _Context, env) -> None:
    """generate.py / eval.py keys that depend on each other (files are checked when they are read)."""
    g, e = cfg.generation, cfg.evaluation
    if g.text_gen_type == "input-file" and not g.sample_input_file:
        raise ctx.error("generation.sample_input_file", "is unset but text_gen_type is input-file",
                        "set sample_input_file to a file of prompts, one per line")
    if e.eval_tasks is not None and (not e.eval_tasks or not all(isinstance(t, str) and t for t in e.eval_tasks)):
        raise ctx.error("evaluation.eval_tasks", f"expected a non-empty list of task names or task YAML paths, got {e.eval_tasks}",
                        "e.g. eval_tasks: [lambada_openai] or eval_tasks: [path/to/task.yaml]")


def _logging(cfg: NeoXConfig, ctx: _Context, env) -> None:
    if cfg.logging.memory_report_allocator and not cfg.logging.memory_report:
        raise ctx.error("logging.memory_report_allocator", "adds the allocator's peaks to the memory report, "
                        "which is off", "set memory_report: true as well")
    log = cfg.logging
    if log.profile and log.profile_step_stop <= log.profile_step_start:
        raise ctx.error("logging.profile_step_stop", f"{log.profile_step_stop} is not after profile_step_start "
                        f"({log.profile_step_start})", "the steps profiled are start .. stop - 1")
    if log.profile and log.memory_report_allocator:
        raise ctx.error("logging.profile", "needs torch.profiler, which memory_report_allocator holds for the "
                        "whole run", "turn one of them off")


def launch_environment_error(cfg: NeoXConfig, env: Mapping[str, str]) -> Optional[str]:
    """One line when the environment cannot run the configured layout, else None: WORLD_SIZE (or,
    under launcher slurm, SLURM_NTASKS) disagrees with it, or the Slurm allocation's node and task
    counts do not match it."""
    expected = world_size_of(cfg)
    names = ["WORLD_SIZE"] + (["SLURM_NTASKS"] if cfg.launcher.launcher == "slurm" else [])
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            given = int(raw)
        except ValueError:
            return f"environment variable {name}={raw!r} is not a rank count"
        if given != expected:
            return (f"the configured layout has {expected} ranks (topology.layout {cfg.topology.layout or [1]}) but "
                    f"{name}={given}; make topology match the allocation (simulate, or the preset's node count)")
    alloc = slurm_allocation(env) if cfg.launcher.launcher == "slurm" else None
    if alloc is not None:
        gpus = uses_gpus(cfg, env)
        needs = layout_mismatch(cfg.topology.layout, alloc, gpus)
        if needs:
            return (f"the Slurm allocation (job {alloc.job_id}) has {alloc.describe(gpus)} but the config's "
                    f"layout {cfg.topology.layout or [1]} needs {needs}; submit with a matching "
                    "-N/--ntasks-per-node, or change topology/num_nodes")
    return None
