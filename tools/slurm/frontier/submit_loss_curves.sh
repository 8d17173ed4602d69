#!/bin/bash
# Submit the Frontier loss-curve comparison (docs/loss_curves.md): the 10B (32 nodes) and 20B (48 nodes)
# models, each under ZeRO-3 and ZeRO-topo (INT8 weights, INT4 gradients), on the same data, seed and
# token budget: four jobs of tools/slurm/frontier/loss_curves.sbatch. Each job, when it ends, redraws
# its model's curves into runs/loss_curves/<MODEL>_loss_curves.{png,csv,md}. From the repository root:
#   ACCOUNT=<PROJECT> bash tools/slurm/frontier/submit_loss_curves.sh [--set KEY=VALUE ...]
# Environment: ACCOUNT (required); MODELS (default "10B 20B"); NODES_10B, NODES_20B (nodes per run,
# default 32 and 48, the paper's; smaller for a smaller partition or a test); TOKENS (default 2e9, per run);
# NOISE_SEED: also a ZeRO-3 run with this seed per model, so the table has a seed-to-seed noise
# (unset: no such run); TIME (sbatch -t, default the script's 02:00:00: longer budgets requeue).
set -euo pipefail
: "${ACCOUNT:?set ACCOUNT to your Frontier project (sbatch -A)}"
if [ ! -f deepy.py ]; then
  echo "$(pwd) is not the NeoX-Topo repository: run this from its root" >&2
  exit 2
fi
script=tools/slurm/frontier/loss_curves.sbatch
time_args=()
[ -n "${TIME:-}" ] && time_args=(-t "${TIME}")
for model in ${MODELS:-10B 20B}; do
  case "${model}" in
    10B) nodes=${NODES_10B:-32} ;;
    20B) nodes=${NODES_20B:-48} ;;
    *) echo "unknown model ${model} in MODELS: use 10B and/or 20B" >&2; exit 2 ;;
  esac
  # The same global batch for every run of a model (4 sequences x 8 GCDs x nodes), so the same
  # token budget is the same number of steps.
  export GLOBAL_BATCH=$((4 * 8 * nodes))
  for preset in zero3 zero_topo; do
    sbatch -A "${ACCOUNT}" -N "${nodes}" "${time_args[@]}" -J "loss-curves-${model}-${preset}" \
      "${script}" "${model}" "${preset}" "$@"
  done
  if [ -n "${NOISE_SEED:-}" ]; then
    SEED="${NOISE_SEED}" sbatch -A "${ACCOUNT}" -N "${nodes}" "${time_args[@]}" \
      -J "loss-curves-${model}-zero3-s${NOISE_SEED}" "${script}" "${model}" zero3 "$@"
  fi
done
