# shellcheck shell=bash
# Environment for NeoX-Topo on OLCF Frontier, sourced by the job scripts from the repository root.
#   NEOX_TOPO_SKIP_MODULES=1  skip the `module load` lines (a cluster without these modules, or a
#                             test Slurm: tools/slurm/local_cluster.sh; docs/launch.md)
#   AWS_OFI_RCCL_LIB          the RCCL network plugin's lib folder (default $HOME/aws-ofi-rccl/lib)
#   NEOX_TOPO_VENV            the venv (default .venv)
# The RCCL/libfabric settings below are also set by deepy.py itself for `topology: {preset: frontier}`
# where unset (megatron/launch/launcher.py FRONTIER_ENV; tests/test_slurm_jobs.py checks that the two
# agree), so `srun` lines that do not go through deepy (tools/probe_links.py) get them too. Sources:
#   [OLCF] OLCF, "PyTorch on Frontier" (docs.olcf.ornl.gov/software/python/pytorch_frontier.html)
#   [HPE]  HPE, "HPE Slingshot Application Note: Running RCCL-Based Applications"
#          (github.com/HewlettPackard/shs-ccl-docs: rccl/rccl_tuning_guide.md, ccl_env.sh)
#   [PCCL] the PCCL authors' Frontier collective runs (github.com/axonn-ai/sc2025-pccl-reproducer,
#          run.sh at commit 5a6353f), whose "clean" runs set the three FI_CXI_RDZV_* values
# A value already in the environment wins (as in deepy).
if [ "${NEOX_TOPO_SKIP_MODULES:-0}" != "1" ]; then
  module load PrgEnv-gnu
  module load rocm
  module load craype-accel-amd-gfx90a
fi
# The RCCL network plugin (aws-ofi-rccl): without it RCCL falls back to TCP sockets on Slingshot.
export LD_LIBRARY_PATH="${AWS_OFI_RCCL_LIB:-$HOME/aws-ofi-rccl/lib}:${LD_LIBRARY_PATH:-}"
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-hsn0}"                  # [OLCF] bootstrap on Slingshot
export NCCL_CROSS_NIC="${NCCL_CROSS_NIC:-1}"                            # [OLCF, HPE]
export NCCL_NET_GDR_LEVEL="${NCCL_NET_GDR_LEVEL:-PHB}"                  # [HPE] GPU-NIC RDMA
export FI_MR_CACHE_MONITOR="${FI_MR_CACHE_MONITOR:-kdreg2}"             # [HPE] kdreg2 or userfaultfd
export FI_CXI_DISABLE_HOST_REGISTER="${FI_CXI_DISABLE_HOST_REGISTER:-1}"  # [HPE] avoids RCCL deadlocks
export HSA_FORCE_FINE_GRAIN_PCIE="${HSA_FORCE_FINE_GRAIN_PCIE:-1}"      # [HPE]
# [HPE, PCCL] Rendezvous for every message (no eager sends): with libfabric's default eager protocol the
# PCCL runs' world all-gathers/reduce-scatters with 64-256 KiB per-rank chunks took 10 ms-1.6 s per call.
export FI_CXI_RDZV_THRESHOLD="${FI_CXI_RDZV_THRESHOLD:-0}"
export FI_CXI_RDZV_GET_MIN="${FI_CXI_RDZV_GET_MIN:-0}"
export FI_CXI_RDZV_EAGER_SIZE="${FI_CXI_RDZV_EAGER_SIZE:-0}"
export FI_CXI_DEFAULT_CQ_SIZE="${FI_CXI_DEFAULT_CQ_SIZE:-131072}"       # [HPE] large jobs
export FI_CXI_DEFAULT_TX_SIZE="${FI_CXI_DEFAULT_TX_SIZE:-2048}"         # [HPE] large jobs
export FI_CXI_RX_MATCH_MODE="${FI_CXI_RX_MATCH_MODE:-hybrid}"           # [HPE] software matching when hardware runs out
# Caches on node-local storage: a shared home directory serialises every rank on its lock [OLCF].
# The folders must exist on every node, not only on the one running this script, and are removed
# from every node when the job script exits (before a requeue too: the job may next run elsewhere).
# Always these names (never a folder of the user's, which the clean-up would delete).
export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER:-neox}-${SLURM_JOB_ID:-0}"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"
export TRITON_CACHE_DIR="/tmp/triton-${USER:-neox}-${SLURM_JOB_ID:-0}"
# One task on each node, counted explicitly: without -n this step would inherit the job's task count
# (SLURM_NTASKS from sbatch --ntasks-per-node) and run several mkdirs per node, or be refused.
neox_topo_nodes="${SLURM_JOB_NUM_NODES:-1}"
srun --nodes="${neox_topo_nodes}" --ntasks="${neox_topo_nodes}" --ntasks-per-node=1 \
  mkdir -p "${MIOPEN_USER_DB_PATH}" "${TRITON_CACHE_DIR}"
neox_topo_remove_node_caches() {
  trap - EXIT
  srun --nodes="${neox_topo_nodes}" --ntasks="${neox_topo_nodes}" --ntasks-per-node=1 \
    rm -rf "${MIOPEN_USER_DB_PATH}" "${TRITON_CACHE_DIR}" || echo "could not remove the node-local caches ${MIOPEN_USER_DB_PATH} ${TRITON_CACHE_DIR}" >&2
}
trap neox_topo_remove_node_caches EXIT
# The project's environment: a venv made by `make venv` over the rocm module's torch
# (--system-site-packages, chosen automatically when the module's python already has torch).
venv="${NEOX_TOPO_VENV:-.venv}"
if [ ! -f "${venv}/bin/activate" ]; then
  echo "no virtual environment at ${venv}: run 'module load rocm && make venv' on a login node first" >&2
  exit 2
fi
# shellcheck disable=SC1091  # the venv is made by `make venv`, not part of the repository
source "${venv}/bin/activate"
