# shellcheck shell=bash
# Environment for NeoX-Topo on OLCF Frontier, sourced by the job scripts from the repository root
# (facts from the OLCF docs). The RCCL/libfabric variables (NCCL_SOCKET_IFNAME, NCCL_CROSS_NIC,
# NCCL_NET_GDR_LEVEL, FI_MR_CACHE_MONITOR=kdreg2, FI_CXI_DISABLE_HOST_REGISTER,
# HSA_FORCE_FINE_GRAIN_PCIE) and MASTER_ADDR/MASTER_PORT are set by deepy.py itself for
# `topology: {preset: frontier}`, where unset: `python deepy.py --dry-run ...` lists them.
module load PrgEnv-gnu
module load rocm
module load craype-accel-amd-gfx90a
# The RCCL network plugin (aws-ofi-rccl): without it RCCL falls back to TCP sockets on Slingshot.
# Point AWS_OFI_RCCL_LIB at your build of the plugin.
export LD_LIBRARY_PATH="${AWS_OFI_RCCL_LIB:-$HOME/aws-ofi-rccl/lib}:${LD_LIBRARY_PATH:-}"
# MIOpen caches on node-local storage: a shared home directory serialises every rank on its lock.
# The folder must exist on every node, not only on the one running this script.
export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER:-neox}-${SLURM_JOB_ID:-0}"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"
srun --nodes="${SLURM_JOB_NUM_NODES:-1}" --ntasks-per-node=1 mkdir -p "${MIOPEN_USER_DB_PATH}"
# The project's environment: a venv made by `make venv` over the rocm module's torch
# (--system-site-packages, chosen automatically when the module's python already has torch).
venv="${NEOX_TOPO_VENV:-.venv}"
if [ ! -f "${venv}/bin/activate" ]; then
  echo "no virtual environment at ${venv}: run 'module load rocm && make venv' on a login node first" >&2
  exit 2
fi
# shellcheck disable=SC1091  # the venv is made by `make venv`, not part of the repository
source "${venv}/bin/activate"
