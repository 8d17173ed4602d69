"""`deepy.py --dry-run`: what a launch would do, printed without starting or writing anything.

The command lines and environments are `launcher.plan_launch`'s, the very plan `launch` executes;
the sharding and its groups are the engine's (`megatron.topology.ShardLayout`); the memory is the memory model's prediction of
model states per device (weights, gradient accumulator, fp32 master and Adam moments, error
feedback), not activations or the units gathered in flight; the step time is the time model's
(docs/time_model.md), on topology.figure_set's figures (frontier-measured on Frontier) or topology.link_figures. With
zero_optimization.plan auto, the layout shown is the one the planner chooses at start-up.
"""
from __future__ import annotations

import shlex
from typing import Mapping, Optional, Sequence

from megatron.config import NeoXConfig, world_size_of
from megatron.config.validate import uses_gpus
from megatron.launch.launcher import LaunchPlan, slurm_hosts
from megatron.topology import ShardLayout, Topology
from megatron.topology.names import TIERS
from megatron.topology.allocation import allocation_from_env
from megatron.analytic.planner import planned_config

GB = 1e9
# Sharded state by group kind, in the ladder's order (docs/engine.md, "Groups").
LADDER_GROUPS = (("weight", "weights 1/w"), ("stride", "gradients 1/g (inside the weight shard)"),
                 ("cross", "optimizer states 1/os (inside the gradient shard)"),
                 ("replica", "replicas of the optimizer slice (allreduce)"))
ZEROPP_GROUPS = (("world", "weights, gradients, optimizer states 1/N"), ("node", "hpZ secondary weight copy 1/R"),
                 ("rail", "qgZ second hop (same local rank on every node)"))
SHOWN_RANKS = 8  # rank table rows and group members printed before eliding


def render_dry_run(cfg: NeoXConfig, plan: LaunchPlan, env: Mapping[str, str], padded_vocab: Optional[int]) -> str:
    lines = ["deepy dry run: nothing was started and nothing was written.", ""]
    lines += _launch_section(cfg, plan, env)
    topology = Topology.from_config(cfg, world_size_of(cfg))
    lines += [""] + _layout_section(cfg, topology, slurm_hosts(env) if plan.kind == "slurm" else [],
                                    on_gpus=uses_gpus(cfg, env))
    if cfg.zero.plan == "auto" and padded_vocab is None:
        lines += ["", "sharding: chosen at start-up by zero_optimization.plan auto; the vocabulary is unknown here, "
                  "so the plan cannot be shown (set vocab_size, or make vocab_file readable)"]
        return "\n".join(lines + [""] + _model_section(cfg, padded_vocab)) + "\n"
    cfg, auto = planned_config(cfg, world_size_of(cfg))
    lines += [""] + _sharding_section(cfg, topology)
    if auto is not None:
        lines.append(f"  chosen by zero_optimization.plan auto: {auto.reason()}")
    lines += [""] + _model_section(cfg, padded_vocab)
    if padded_vocab is not None:
        lines += _time_section(cfg, padded_vocab)
    return "\n".join(lines) + "\n"


def _time_section(cfg: NeoXConfig, padded_vocab: int) -> list[str]:
    """The step-time model's prediction for this run (docs/time_model.md): rough on a figure set,
    calibrated with topology.link_figures (a probe of the machine); names the figures it used."""
    from megatron.analytic.model_inputs import (comm_spec_from_config, figures_note, hardware_from_config,
                                                 step_work_from_config)
    from megatron.analytic.time_model import step_time
    hw = hardware_from_config(cfg)
    note = figures_note(cfg)
    st = step_time(comm_spec_from_config(cfg, padded_vocab), hw, step_work_from_config(cfg, padded_vocab))
    top = sorted(((s, phase) for phase, s in st.exposed_s.items() if s > 0), reverse=True)[:4]
    parts = ", ".join(f"{phase} {s:.4g} s" for s, phase in top)
    return [f"predicted optimizer step (time model, figures {hw.source}): {st.total_s:.4g} s, "
            f"{st.tflops_per_device:.3g} model TFLOPS per device; most of it: {parts}"] + ([note] if note else [])


def _launch_section(cfg: NeoXConfig, plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    files = " ".join(entry["path"] for entry in cfg.config_files)
    lines = [f"config files: {files}" + (f"; overrides: {' '.join(cfg.overrides)}" if cfg.overrides else "")]
    alloc = allocation_from_env(env)
    where = "this machine"
    if alloc is not None:
        where = f"inside Slurm job {alloc.job_id}: {alloc.describe(uses_gpus=uses_gpus(cfg, env))}"
    lines.append(f"launcher: {plan.kind} ({where})")
    lines += [f"note: {note}" for note in plan.notes]
    if plan.kind == "local" and len(plan.commands) > 1:
        lines.append(f"commands: {len(plan.commands)} processes on this machine, each running")
    else:
        lines.append("command:")
    lines.append("  " + shlex.join(plan.commands[0]))
    changed = _changed(env, plan.envs[0])
    per_rank = plan.kind == "local" and len(plan.envs) > 1
    lines.append("environment deepy sets (the rest is inherited)" + (", rank 0; rank k sets RANK=LOCAL_RANK=k:" if per_rank else ":"))
    lines += [f"  {key}={value}" for key, value in changed] or ["  (nothing)"]
    return lines


def _changed(base: Mapping[str, str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in env.items() if base.get(k) != v)


def _layout_section(cfg: NeoXConfig, topology: Topology, hosts: Sequence[str], on_gpus: bool) -> list[str]:
    n, per_node = topology.world_size, topology.ranks_per_node
    # A simulated layout names its tiers as the machine it stands for; a real CPU run has no GPUs.
    gpu_nouns = on_gpus or cfg.topology.simulate is not None
    tiers = " x ".join(f"{t.size} {_tier_noun(t.name, gpu_nouns)}" for t in reversed(topology.tiers))
    lines = [f"world size: {n} rank{'s' if n != 1 else ''} = {tiers} ({topology.name}); {per_node} rank(s) per node"]
    if topology.num_tiers == 3:
        formula = f"rank = node x {per_node} + gpu x {topology.gcds_per_gpu} + gcd"
    else:
        formula = f"rank = node x {per_node} + local"
    lines.append(f"rank mapping: {formula} (block distribution: node k holds ranks "
                 f"{per_node}k..{per_node}k+{per_node - 1})")
    header = "  rank  node  gpu  gcd" if topology.num_tiers == 3 else "  rank  node  local"
    lines.append(header)
    shown = list(range(min(n, SHOWN_RANKS)))
    for rank in shown:
        c = topology.coordinates(rank)
        lines.append(f"  {rank:>4}  {c.node:>4}  {c.gpu:>3}  {c.gcd:>3}" if topology.num_tiers == 3
                     else f"  {rank:>4}  {c.node:>4}  {c.gpu:>5}")
    if n > len(shown):
        lines.append(f"  ... ({n - len(shown)} more; the pattern repeats on every node)")
    if cfg.topology.preset == "frontier":
        lines.append("  under srun --gpu-bind=closest, local ranks 0..7 see GCDs 4,5,2,3,6,7,0,1: ranks 2k and 2k+1 "
                     "are the two GCDs of one MI250X (checked at start-up on ROCm)")
    if hosts:
        named = [f"{host} (ranks {k * per_node}-{(k + 1) * per_node - 1})" for k, host in enumerate(hosts[:4])]
        more = f", ... {len(hosts) - 4} more" if len(hosts) > 4 else ""
        lines.append(f"nodes: {', '.join(named)}{more}")
    return lines


def _tier_noun(name: str, gpus: bool = True) -> str:
    if not gpus and name == "intra_node":
        return "ranks per node"
    return {"inter_node": "nodes", "intra_node": "GPUs", "intra_gpu": "GCDs"}[name]


def _sharding_section(cfg: NeoXConfig, topology: Topology) -> list[str]:
    layout = ShardLayout.from_config(cfg)
    w, g, os_ = layout.factors.as_tuple()
    lines = [f"sharding: {layout.preset}, (w, g, os) = ({w}, {g}, {os_}) on N = {layout.world_size}"]
    kinds = ZEROPP_GROUPS if layout.hpz else LADDER_GROUPS
    for kind, what in kinds:
        ranks = layout.group(kind, 0)
        lines.append(f"  {kind:<8} group of {len(ranks):>4}: {what}; spans {_span(ranks, topology)}; "
                     f"rank 0's: {_members(ranks)}")
    return lines


def _span(ranks: Sequence[int], topology: Topology) -> str:
    """The slowest tier any two members talk across (a group of one rank sends nothing)."""
    if len(ranks) < 2:
        return "nothing (one rank, no collective)"
    tiers = {topology.tier_between(ranks[0], other) for other in ranks[1:]}
    return max(tiers, key=TIERS.index)


def _members(ranks: Sequence[int]) -> str:
    if len(ranks) <= SHOWN_RANKS:
        return "{" + ", ".join(map(str, ranks)) + "}"
    return "{" + ", ".join(map(str, ranks[:4])) + f", ..., {ranks[-1]}" + "}"


def _shape(m) -> str:
    """The block as built: heads (and K/V heads), norm, MLP kind and inner width, window."""
    from megatron.config.model_shape import kv_heads, mlp_widths
    heads = f"{m.num_attention_heads} heads"
    if kv_heads(m) != m.num_attention_heads:
        heads += f" ({kv_heads(m)} K/V heads)"
    mlp = f"{m.activation} MLP {mlp_widths(m).inner}"
    window = f", sliding window {m.sliding_window_width}" if m.sliding_window_width is not None else ""
    return f"{m.num_layers} layers, hidden {m.hidden_size}, {heads}, {m.norm}, {mlp}{window}, seq {m.seq_length}"


def _model_section(cfg: NeoXConfig, padded_vocab: Optional[int]) -> list[str]:
    from megatron.model.sizes import parameter_count
    from megatron.analytic.memory_model import predict_model_state_bytes
    from megatron.analytic.model_inputs import comm_spec_from_config

    m = cfg.model
    shape = _shape(m)
    if padded_vocab is None:
        return [f"model: {shape}; vocabulary unknown (set vocab_size, or make vocab_file "
                f"{cfg.tokenizer.vocab_file!r} readable here): no parameter count or memory"]
    params = parameter_count(m, padded_vocab)
    lines = [f"model: {shape}, vocabulary {padded_vocab:,} (padded): {params:,} parameters ({params / 1e9:.2f}B)"]
    states = predict_model_state_bytes(comm_spec_from_config(cfg, padded_vocab))["per_rank"]
    parts = ", ".join(f"{cat.replace('_', ' ')} {nbytes / GB:.2f}" for cat, nbytes in states.items()
                      if cat != "total" and nbytes)
    compute = {"fp32": "fp32", "bfloat16": "bf16", "fp16": "fp16"}[cfg.precision.precision]
    lines.append(f"model states per device (memory model; {compute} weights, fp32 gradients, master and Adam): "
                 f"{states['total'] / GB:.2f} GB = {parts} GB")
    lines.append(f"  {states['total'] / params:.2f} bytes per parameter; activations, gathered units and "
                 "buffers in flight come on top")
    return lines

