# Environment for NeoX-Topo on Frontier (sourced by the job scripts). Facts from the OLCF docs.
module load PrgEnv-gnu
module load rocm
module load craype-accel-amd-gfx90a
# The RCCL network plugin (aws-ofi-rccl): without it RCCL falls back to TCP sockets on Slingshot.
# Point this at your build of the plugin.
export LD_LIBRARY_PATH="${AWS_OFI_RCCL_LIB:-$HOME/aws-ofi-rccl/lib}:${LD_LIBRARY_PATH:-}"
export NCCL_SOCKET_IFNAME=hsn0
export NCCL_CROSS_NIC=1
export NCCL_NET_GDR_LEVEL=PHB
export FI_MR_CACHE_MONITOR=kdreg2        # never memhooks with RCCL
export FI_CXI_DISABLE_HOST_REGISTER=1
export HSA_FORCE_FINE_GRAIN_PCIE=1
# MIOpen caches on node-local storage: a shared home directory serialises every rank on its lock.
export MIOPEN_USER_DB_PATH="/tmp/miopen-${USER}-${SLURM_JOB_ID:-0}"
export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"
mkdir -p "${MIOPEN_USER_DB_PATH}"
export MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-29500}
# Activate the project's environment (a venv created with --system-site-packages over the module's
# torch, which `make venv` does automatically when the module's python already has torch).
source "${NEOX_TOPO_VENV:-.venv}/bin/activate"
