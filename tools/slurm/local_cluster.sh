#!/bin/bash
# A real Slurm on this one machine, to run the shipped job scripts as a cluster would: Debian's
# slurm-wlm (slurmctld + two slurmd, emulated nodes node1 and node2) and a munged of its own, with
# no cgroups (proctrack/linuxproc, task/none) so it runs in a container too.
#   tools/slurm/local_cluster.sh start     # installs slurm-wlm and munge if missing (root: apt-get)
#   eval "$(tools/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/srun/squeue/scontrol
#   sbatch -N 2 --ntasks-per-node=2 ...    # partition `batch` (the Frontier scripts' -p), 2 nodes
#   tools/slurm/local_cluster.sh status
#   tools/slurm/local_cluster.sh stop      # cancels the cluster's jobs, stops only the daemons it started
# Environment: NEOX_SLURM_DIR (config, state, logs and pid files; default /tmp/neox-topo-slurm-<user>),
# NEOX_SLURM_PORT (slurmctld's port; the two slurmd take the next two; default 16817, off Slurm's
# own 6817-6818 so a site's Slurm on this host is left alone), NEOX_SLURM_CPUS (CPUs each emulated
# node declares, default 4: more than a small host has, so 2 nodes x 2 tasks fit on 2 cores;
# SlurmdParameters=config_overrides lets slurmd accept that).
# Everything it starts is named by a pid file under NEOX_SLURM_DIR/run; `stop` signals those pids only.
set -euo pipefail

work=${NEOX_SLURM_DIR:-/tmp/neox-topo-slurm-$(id -un)}
port=${NEOX_SLURM_PORT:-16817}
cpus=${NEOX_SLURM_CPUS:-4}
nodes=(node1 node2)
conf="${work}/slurm.conf"
run="${work}/run"

say() { echo "local_cluster: $*" >&2; }

install_if_missing() {
  local tool missing=0
  for tool in slurmctld slurmd sbatch srun scontrol munged mungekey; do
    command -v "${tool}" >/dev/null 2>&1 || missing=1
  done
  [ "${missing}" -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "slurm-wlm and munge are not installed, and this is not root on a Debian-like system: install them (apt-get install slurm-wlm munge)"
    exit 2
  fi
  say "installing slurm-wlm and munge (apt-get)"
  # An image whose package lists are stale or absent gets them once, then the install is retried.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
}

# The pid in a pid file when that process is alive, else nothing.
live_pid() {
  local file=$1 pid
  [ -f "${file}" ] || return 1
  pid=$(cat "${file}")
  [ -n "${pid}" ] && kill -0 "${pid}" 2>/dev/null && echo "${pid}"
}

write_config() {
  local host user
  host=$(hostname -s)
  user=$(id -un)
  mkdir -p "${work}/state" "${work}/log" "${run}" "${work}/munge"
  for node in "${nodes[@]}"; do mkdir -p "${work}/spool/${node}"; done
  cat > "${conf}" <<EOF
# Written by tools/slurm/local_cluster.sh; rewritten on every start.
ClusterName=neoxlocal
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${port}
SlurmUser=${user}
SlurmdUser=${user}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=${work}/munge/munge.socket,cred_expire=${NEOX_SLURM_CRED_EXPIRE:-10}
StateSaveLocation=${work}/state
SlurmdSpoolDir=${work}/spool/%n
SlurmctldPidFile=${run}/slurmctld.pid
SlurmdPidFile=${run}/slurmd-%n.pid
SlurmctldLogFile=${work}/log/slurmctld.log
SlurmdLogFile=${work}/log/slurmd-%n.log
# No cgroups: processes tracked by their parentage, tasks not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# One line per job end (requeues included): what the tests read to prove no job ended FAILED.
JobCompType=jobcomp/filetxt
JobCompLoc=${work}/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Passes every 2 s (defaults 60 and 30 s): a requeued job, eligible again after cred_expire, starts then.
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=10
MinJobAge=3600
InactiveLimit=0
PlugStackConfig=${work}/plugstack.conf
NodeName=node1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=${cpus} RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=${cpus} RealMemory=4000 State=UNKNOWN
PartitionName=batch Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
  : > "${work}/plugstack.conf"  # no SPANK plugins (the system's plugstack.conf is not ours)
}

start_munge() {
  if live_pid "${run}/munged.pid" >/dev/null; then return 0; fi
  [ -f "${work}/munge/munge.key" ] || mungekey --create --keyfile="${work}/munge/munge.key"
  chmod 700 "${work}/munge"
  chmod 600 "${work}/munge/munge.key"
  # --force: the socket folder lives under /tmp, whose permissions munged would otherwise refuse.
  munged --force --key-file="${work}/munge/munge.key" --socket="${work}/munge/munge.socket" \
    --pid-file="${run}/munged.pid" --log-file="${work}/log/munged.log" --seed-file="${work}/munge/munged.seed"
}

start_daemons() {
  if ! live_pid "${run}/slurmctld.pid" >/dev/null; then
    # -c: a fresh start without the previous run's jobs (their processes are gone).
    slurmctld -c -f "${conf}"
  fi
  for node in "${nodes[@]}"; do
    live_pid "${run}/slurmd-${node}.pid" >/dev/null || slurmd -f "${conf}" -N "${node}"
  done
}

wait_until_idle() {
  local states
  for _ in $(seq 60); do
    states=$(SLURM_CONF="${conf}" sinfo -h -N -o '%N %T' 2>/dev/null | sort -u || true)
    if [ "$(grep -c -E ' (idle|mixed|allocated)$' <<< "${states}")" -eq "${#nodes[@]}" ]; then
      say "up: ${#nodes[@]} nodes ($(tr '\n' ' ' <<< "${states}"| sed 's/ $//')), partition batch; SLURM_CONF=${conf}"
      return 0
    fi
    sleep 0.5
  done
  say "the nodes did not come up within 30 s: sinfo says '${states:-nothing}'; logs in ${work}/log"
  return 1
}

# The emulated nodes' names must resolve (deepy's MASTER_ADDR is the allocation's first node name): a
# marked line in /etc/hosts, added only for names that do not resolve, removed again by `stop`.
hosts_marker="# neox-topo local_cluster ${work}"
add_host_names() {
  local node missing=()
  for node in "${nodes[@]}"; do getent hosts "${node}" >/dev/null || missing+=("${node}"); done
  [ "${#missing[@]}" -eq 0 ] && return 0
  if [ ! -w /etc/hosts ]; then
    say "the node names ${missing[*]} do not resolve and /etc/hosts is not writable: add '127.0.0.1 ${missing[*]}' to it"
    exit 2
  fi
  echo "127.0.0.1 ${missing[*]} ${hosts_marker}" >> /etc/hosts
}
remove_host_names() {
  grep -qF "${hosts_marker}" /etc/hosts 2>/dev/null || return 0
  grep -vF "${hosts_marker}" /etc/hosts > "${work}/hosts.kept"
  cat "${work}/hosts.kept" > /etc/hosts  # rewritten in place: in a container /etc/hosts is often a mount
  rm -f "${work}/hosts.kept"
}

stop_pid_file() {
  local file=$1 pid
  pid=$(live_pid "${file}") || { rm -f "${file}"; return 0; }
  kill "${pid}"
  for _ in $(seq 50); do kill -0 "${pid}" 2>/dev/null || break; sleep 0.2; done
  kill -0 "${pid}" 2>/dev/null && kill -9 "${pid}"
  rm -f "${file}"
}

stop_cluster() {
  if live_pid "${run}/slurmctld.pid" >/dev/null; then
    # The cluster's own jobs first, so no task outlives the daemons that track it.
    SLURM_CONF="${conf}" scancel --full --quiet --partition=batch 2>/dev/null || true
    for _ in $(seq 30); do
      [ -z "$(SLURM_CONF="${conf}" squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  for node in "${nodes[@]}"; do stop_pid_file "${run}/slurmd-${node}.pid"; done
  stop_pid_file "${run}/slurmctld.pid"
  stop_pid_file "${run}/munged.pid"
  remove_host_names
  say "stopped"
}

status() {
  local name file pid code=0
  for name in munged slurmctld slurmd-node1 slurmd-node2; do
    file="${run}/${name}.pid"
    if pid=$(live_pid "${file}"); then echo "${name}: running (pid ${pid})"; else echo "${name}: not running"; code=3; fi
  done
  [ "${code}" -eq 0 ] && SLURM_CONF="${conf}" sinfo -N
  return "${code}"
}

case "${1:-}" in
  start)
    install_if_missing
    write_config
    add_host_names
    start_munge
    start_daemons
    wait_until_idle ;;
  stop) stop_cluster ;;
  status) status ;;
  env) echo "export SLURM_CONF=${conf}" ;;
  *) echo "usage: tools/slurm/local_cluster.sh start|stop|status|env" >&2; exit 2 ;;
esac
