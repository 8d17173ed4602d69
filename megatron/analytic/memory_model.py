"""Model states held per rank (docs/engine.md, "Model states held per rank"), and NeoX unit sizes.

Like ``comm_model`` this is an independent statement of the engine's contract: it imports nothing
from the engine or the model, and the tests check it against both.
"""
from __future__ import annotations

from megatron.topology.names import MEMORY_CATEGORIES
from megatron.analytic.comm_model import (FP32_BYTES, CommModelError, CommSpec, gradient_hop_bytes,
                                           packed_message_bytes, padded_unit_numels)

# error_feedback appears in a prediction only when residuals are kept (see predict_model_state_bytes).
CATEGORIES = MEMORY_CATEGORIES


def predict_model_state_bytes(spec: CommSpec) -> dict:
    """{rank: {category: bytes}} for every rank, plus 'per_rank': the largest value over ranks.

    Categories: weights (S/w x c), secondary (zeropp only: S/R x c, or the packed message of
    S/R elements with quantized weights), grad_accumulator (S/g x 4), master (S/os x 4), moments
    (2 x S/os x 4), error_feedback (present only when ``quant.error_feedback`` keeps a residual, i.e.
    the reduction hop across nodes is quantized: see ``error_feedback_elements``), and their 'total'. Every rank holds equal shards (S is padded to a
    multiple of the sharding), so all ranks report the same bytes; the per-rank form is kept so a
    measured table can be compared rank by rank.
    """
    held = model_state_bytes_per_rank(spec)
    out: dict = {rank: dict(held) for rank in range(spec.world_size)}
    out["per_rank"] = {cat: max(out[r][cat] for r in range(spec.world_size)) for cat in held}
    return out


def model_state_bytes_per_rank(spec: CommSpec) -> dict:
    """{category: bytes} one rank holds (``predict_model_state_bytes``' "per_rank", without the
    rank-by-rank form: the peak and the planner ask for it thousands of times at 384 ranks)."""
    w, g, os_ = spec.factors
    c, r = spec.compute_bytes, spec.ranks_per_node
    bits, block = spec.quant.weight_gather_bits, spec.quant.block_size
    sizes = padded_unit_numels(spec)
    secondary = (sum(packed_message_bytes(s // r, bits, block) for s in sizes) if bits
                 else sum(s // r for s in sizes) * c)
    held = {
        "weights": sum(s // w for s in sizes) * c,
        "secondary": secondary if spec.layout.hpz else 0,
        "grad_accumulator": sum(s // g for s in sizes) * FP32_BYTES,
        "master": sum(s // os_ for s in sizes) * FP32_BYTES,
        "moments": 2 * sum(s // os_ for s in sizes) * FP32_BYTES,
    }
    residuals = sum(error_feedback_elements(spec, s) for s in sizes) * FP32_BYTES
    if residuals:
        held["error_feedback"] = residuals
    held["total"] = sum(held.values())
    return held


def error_feedback_elements(spec: CommSpec, padded_numel: int) -> int:
    """fp32 residual elements kept for one unit of S = ``padded_numel``. Error feedback corrects the
    reduction hop that crosses nodes only, with a residual the size of this rank's input to it: the
    ladder's cross hop S/g (over os/g ranks), zeropp's rail hop S/R (over N/R ranks). The hops
    inside a node keep none. A hop over a group of one rank does not exist (no collective,
    nothing quantized), so it keeps no residual either."""
    if not spec.quant.error_feedback:
        return 0
    w, g, os_ = spec.factors
    n, r, s = spec.world_size, spec.ranks_per_node, padded_numel
    if spec.layout.hpz:
        return s // r if n // r > 1 and spec.quant.grad_reduce_bits else 0
    return s // g if os_ // g > 1 and spec.quant.cross_node_grad_bits else 0


def neox_unit_sizes(num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                    intermediate_size: int | None = None, untied: bool = True) -> list:
    """Parameter counts of a GPT-NeoX model's units in forward order: embedding, blocks, final.

    Counted from the architecture: embedding V x h; each block two LayerNorms (4h), fused QKV
    (3h^2 + 3h), attention dense (h^2 + h), MLP in (h x I + I) and out (I x h + h) with I = 4h by
    default; final LayerNorm (2h) plus the output layer (V x h) when untied. ``vocab_size`` is the
    padded vocabulary; heads do not change the count but must divide the width.
    """
    if min(num_layers, hidden_size, num_attention_heads, vocab_size) < 1:
        raise CommModelError("num_layers, hidden_size, num_attention_heads and vocab_size must be positive")
    if hidden_size % num_attention_heads:
        raise CommModelError(f"num_attention_heads={num_attention_heads} must divide hidden_size={hidden_size}")
    h, v = hidden_size, vocab_size
    inner = intermediate_size if intermediate_size is not None else 4 * h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    final = 2 * h + (v * h if untied else 0)
    return [v * h] + [block] * num_layers + [final]


PEAK_PHASES = ("build", "step", "save", "load")


def predict_peak_bytes(spec: CommSpec, activations=0, autocast_copies: int = 0) -> dict:
    """{phase: {term: bytes, ..., 'total'}}: what one rank holds at the peak of each phase, above the
    process's own baseline (interpreter and libraries, measured), following docs/engine.md's build,
    step, save and load. ``activations`` is the model's estimate for one micro-batch: a pair, at the
    start of backward and in the first block's backward (megatron.model.sizes.backward_activation_bytes),
    or one figure taken for both. A layout of one rank runs the single-process engine,
    not the sharded one: ``predict_single_process_peak_bytes`` (``autocast_copies`` counts there only).

    ZeRO++'s secondary copy (hpZ) is a state of the step only: each step's first gather of a unit
    rebuilds it and the step's end drops it (engine/schedules.py), so build, save and load hold the
    states without it.

    - build: the model states, plus the largest unit being made real, in two terms because they
      live in different memories on a GPU: "unit being built (host)", its parameters in fp32
      (P x 4, initialised or read on the CPU: build.unit_materializer), from which only this
      rank's weight chunk and optimizer slice are copied to the device (states, no staging buffer);
      and "unit being built (device)", the flat buffer in the compute dtype (S x c), allocated on
      the engine's device and released at once when the unit is sharded (w > 1; with w = 1 it is
      the weights themselves, a state). On a CPU run both terms are host memory. The unit is the
      one with the largest sum (the same unit for both terms, so the total is one unit's).
      With error feedback the states include the residuals, which the engine allocates after the
      last unit is built: the real build peak is the larger of (states without them + one unit)
      and all the states, so this over-predicts the build by up to the residuals (docs/memory.md).
    - step: the larger of two moments. In a block's backward: the states, plus up to two sharded
      units gathered or in flight (prefetch), the gathered unit's gradient (S x c) and the
      reduction's first output (S / w x c) — with overlap_comm, the unit gradient autograd is
      producing plus M = reduce_buckets_in_flight pieces in flight, each its input and first output
      (p x c + p / w x c, p = min(S, bucket)) — plus that moment's activations. At the start of
      backward (the head's backward, before any unit's gradient exists): the states, the two
      gathered units and that moment's activations, no reduction.
    - save: the states, plus this rank's fp32 master and moments cloned into the file's pieces (with
      weight deltas also the weights held, in the compute dtype), and with error feedback its
      residuals too (each rank's file carries its own: state_io). Weight deltas hold no other state:
      the weights the changes are taken against are the weight chunk itself.
    - load: the states, plus the checkpoint pages read (the three fp32 optimizer slices of every
      unit, memory-mapped until the load ends: clean file pages, host memory the kernel can
      reclaim, but resident and so in the measured peak), plus the largest unit's staging: its
      three slices copied out and the weight refresh's buffers (the master cast to the compute
      dtype, S/os x c, unless already fp32, and the cross hop's S/g x c result).
    """
    if spec.world_size == 1:
        return predict_single_process_peak_bytes(spec, activations, autocast_copies)
    at_start, in_backward = _activation_moments(activations)
    held = model_state_bytes_per_rank(spec)
    states, residuals = held["total"], held.get("error_feedback", 0)
    between_steps = states - held["secondary"]  # hpZ's copy lives from a step's first gather to its end
    w, g, os_ = spec.factors
    c = spec.compute_bytes
    sizes = padded_unit_numels(spec)
    largest = max(sizes)
    sharded = w > 1
    # a piece element: fp32 master and moments, and with weight deltas the weights held (dtype c)
    piece_bytes = 3 * FP32_BYTES + (c if spec.quant.weight_delta_bits else 0)
    built_p, built_s = max(zip(spec.unit_numels, sizes), key=lambda ps: ps[0] * FP32_BYTES + (ps[1] * c if sharded else 0))
    in_step = {"states": states, "gathered units": (2 * largest * c) if sharded else 0}
    reductions = _reduction_terms(spec, largest)
    terms = {
        "build": {"states": between_steps, "unit being built (host)": built_p * FP32_BYTES,
                  "unit being built (device)": built_s * c if sharded else 0},
        "step": _larger({**in_step, **reductions, "activations": in_backward},
                        {**in_step, **dict.fromkeys(reductions, 0), "activations": at_start}),
        "save": {"states": between_steps, "checkpoint pieces": sum(s // os_ for s in sizes) * piece_bytes + residuals},
        "load": {"states": between_steps, "mapped pages": sum(s // os_ for s in sizes) * piece_bytes,
                 "unit being loaded": max(3 * (s // os_) * FP32_BYTES + (s // os_) * c * (c != FP32_BYTES)
                                          + (s // g) * c for s in sizes)},
    }
    for phase in terms.values():
        phase["total"] = sum(phase.values())
    return terms


def predict_single_process_peak_bytes(spec: CommSpec, activations=0, autocast_copies: int = 0) -> dict:
    """The phases of one process (megatron/engine/single_process.py): fp32 parameters (4 P), fp32
    gradients (4 P, set to None after each step) and AdamW's two fp32 moments (8 P, made by the first
    step), none of them padded or sharded; ``autocast_copies`` are the compute-dtype copies autocast
    keeps of the weights (``model.sizes.autocast_copy_bytes``).

    - build: the parameters. On a GPU the model is built (seeded, as on the CPU) in host memory and
      then moved, so the host briefly holds its own 4 P as well; that copy is not a term.
    - step: the larger of two moments. The start of backward: parameters, moments, the activations
      and autocast's copies, and from the second micro-batch of an accumulating step the gradients
      too. The optimizer: parameters, gradients and moments (clipping and the fused AdamW work in
      place).
    - save: parameters and moments, plus the checkpoint's pieces (12 P: master and moments copied to
      host memory).
    - load: parameters and moments, plus the checkpoint's pages (12 P, mapped). On a CPU the moments
      are the buffers the reader fills; on a GPU those buffers are host memory, one parameter's at a
      time (not a term).
    """
    params = sum(spec.unit_numels) * FP32_BYTES
    moments = 2 * params
    activations = max(_activation_moments(activations))  # no reductions: the larger moment is the peak
    held = {"parameters": params, "moments": moments}
    terms = {
        "build": {"parameters": params},
        "step": _larger({**held, "gradients": params, "activations": 0, "autocast copies": 0},  # the optimizer
                        {**held, "gradients": params if spec.micro_batches > 1 else 0, "activations": activations,
                         "autocast copies": autocast_copies}),  # the start of backward
        "save": {"parameters": params, "moments": moments, "checkpoint pieces": 3 * params},
        "load": {"parameters": params, "moments": moments, "mapped pages": 3 * params},
    }
    for phase in terms.values():
        phase["total"] = sum(phase.values())
    return terms


# Terms of predict_peak_bytes that are host memory when the engine runs on a GPU (docs/memory.md,
# "Host and device"); the loaded unit's three fp32 slices (host, a few MB) stay in with its refresh.
HOST_TERMS = ("unit being built (host)", "checkpoint pieces", "mapped pages")


def device_phase_bytes(phase: dict) -> int:
    """One phase of ``predict_peak_bytes`` without its host terms: what that phase holds on a GPU."""
    return phase["total"] - sum(phase.get(term, 0) for term in HOST_TERMS)


def device_peak_bytes(peaks: dict) -> int:
    """The largest phase total of ``predict_peak_bytes`` without its host terms: what must fit in a
    GPU's memory (on a CPU run host and device are one memory; use the phase totals there)."""
    return max(device_phase_bytes(phase) for phase in peaks.values())


def _activation_moments(activations) -> tuple[int, int]:
    """(start of backward, in a block's backward) from a pair, or one figure taken for both."""
    if isinstance(activations, int):
        return activations, activations
    at_start, in_backward = activations
    return at_start, in_backward


def _larger(*moments: dict) -> dict:
    """The moment whose terms sum to the most (the first of equals)."""
    return max(moments, key=lambda terms: sum(terms.values()))


def _reduction_terms(spec: CommSpec, largest: int) -> dict:
    """The gradient reduction's transient buffers at the step's peak (docs/engine.md, "Overlapped
    gradient reduction"): synchronous, one unit's gradient and its first hop's output; overlapped,
    the gradient being produced while M pieces are in flight with their inputs and first outputs.
    A unit's gradient is made by autograd from its parameters' gradients, concatenated into the one
    flat gradient (the backward of the split into parameter views): for a moment both exist, 2 S c
    ("unit gradient"; measured: tools/rehearse.py, a deep zero3 step held one unit more than the
    single S c). An unquantized first hop whose group spans nodes runs in fp32 with fp32_allreduce
    (e bytes an element, else e = c): its input is the piece cast to fp32, which replaces an
    overlapped piece's copy but sits beside a synchronous unit's gradient ("reduction input cast"),
    once the parameters' gradients are gone."""
    w, c = spec.factors[0], spec.compute_bytes
    e = c if spec.quant.grad_reduce_bits else gradient_hop_bytes("weight" if w > 1 else "stride", spec)
    concatenating = 2 * largest * c
    if spec.reductions_in_flight == 0:
        cast = largest * e if e != c else 0
        return _larger({"unit gradient": concatenating, "reduction input cast": 0, "reduction output": 0},
                       {"unit gradient": largest * c, "reduction input cast": cast, "reduction output": largest // w * e})
    piece = min(largest, spec.reduce_bucket_elements)
    return {"unit gradient": concatenating,
            "reductions in flight": spec.reductions_in_flight * (piece * e + piece // w * e)}
