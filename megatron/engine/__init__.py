"""The runtime engines: the loop's interface (protocol.py), the single-process engine and the
ZeRO-topo engine with its parts (flat units, schedules, collectives, ledger, optimizer, states).
The analytic models (megatron/analytic/) never import this package: they check it."""
from megatron.engine.comm import CommError, Communicator
from megatron.engine.flat_unit import EngineError
from megatron.engine.ledger import PHASES, TIERS, ByteLedger, LedgerError
from megatron.engine.protocol import (Engine, LossFn, adamw_param_groups, autocast_dtype_of, fused_lm_loss, lm_loss,
                                       no_decay, training_loss_of)
from megatron.engine.single_process import SingleProcessEngine
from megatron.engine.zero_topo import ZeroTopoEngine

__all__ = ["ByteLedger", "CommError", "Communicator", "Engine", "EngineError", "LedgerError", "LossFn", "PHASES",
           "SingleProcessEngine", "TIERS", "ZeroTopoEngine", "adamw_param_groups", "autocast_dtype_of", "fused_lm_loss",
           "lm_loss", "no_decay", "training_loss_of"]
