"""The ZeRO-topo engine: flat parameter units sharded by (w, g, os), the collective wrapper and its
byte ledger. ``comm_model`` (the analytic model) is deliberately not imported here: it must stay
independent of the engine."""
from megatron.zero_topo.comm import CommError, Communicator
from megatron.zero_topo.engine import ZeroTopoEngine
from megatron.zero_topo.flat_unit import EngineError
from megatron.zero_topo.ledger import PHASES, TIERS, ByteLedger, LedgerError

__all__ = ["CommError", "Communicator", "ZeroTopoEngine", "EngineError", "PHASES", "TIERS", "ByteLedger",
           "LedgerError"]
