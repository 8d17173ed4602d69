"""The analytic models of a run, computed from its configuration alone: bytes per link tier
(comm_model, deepspeed_model), memory per rank (memory_model), step time (time_model on the
figures of hardware / figure_sets) and the layout planner. They import nothing from the runtime
engine (megatron/engine/), whose byte ledger and measured memory they are tested against."""
