"""The names the engine, its byte ledger, its memory accounting and the analytic models share.

The ledger and the communication model are compared entry by entry, and the engine's measured model
states against the memory model category by category, so both sides spell every key from here:
one module, imported by the runtime (megatron/engine/) and by the models (megatron/analytic/),
which import nothing else of each other.
"""
from __future__ import annotations

# Link tiers, fastest first; a two-tier layout (nodes x ranks) has no intra_gpu tier.
TIERS = ("intra_gpu", "intra_node", "inter_node")
# Tier names by layout depth, slowest tier first (the order of a layout's sizes).
TIERS_BY_DEPTH = {2: ("inter_node", "intra_node"), 3: ("inter_node", "intra_node", "intra_gpu")}

# The phases of one optimizer step (docs/engine.md), then "checkpoint" for collectives made outside
# the step (full-state gathers, weight rebuilds after a load, index gathers): kept apart so a
# step's table stays exact. The models predict the step phases.
STEP_PHASES = ("fwd_gather", "bwd_gather", "recompute_gather", "eval_gather", "grad_reduce",
               "cross_grad_reduce", "replica_allreduce", "refresh", "control")
PHASES = STEP_PHASES + ("checkpoint",)

# The kinds of process group (megatron/topology/layout.py says which ranks each holds); world last.
GROUP_KINDS = ("weight", "stride", "cross", "replica", "node", "rail", "world")

# Collective operations, as the ledger charges them and the models count them.
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, BROADCAST = (
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, BROADCAST)

# Model-state memory per rank, by what the bytes hold (docs/memory.md): the full or sharded
# weights, zeropp's node-level secondary copy, the fp32 gradient accumulator, the fp32 master
# slice, both AdamW moments, error-feedback residuals.
MEMORY_CATEGORIES = ("weights", "secondary", "grad_accumulator", "master", "moments", "error_feedback")
