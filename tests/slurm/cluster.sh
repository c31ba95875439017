#!/usr/bin/env bash
# A one-machine SLURM cluster on localhost for the real-controller tests, kept in one folder:
#
#   tests/slurm/cluster.sh install        install Debian's slurmctld, slurmd, munge and slurm-client
#                                         (as root, only what is missing)
#   tests/slurm/cluster.sh start DIR [CPUS]  write DIR/slurm.conf and a munge key, start munged,
#                                         slurmctld and slurmd with their state, logs and PID files in
#                                         DIR; the node declares CPUS CPUs (default 16)
#   tests/slurm/cluster.sh stop DIR       stop the daemons started in DIR by their PIDs
#
# After `start`, client commands talk to this cluster with SLURM_CONF=DIR/slurm.conf. Nothing is
# written outside DIR: no systemd, no cgroups (ProctrackType=proctrack/linuxproc,
# TaskPlugin=task/none), no accounting daemon. The node may declare more CPUs than the machine has
# (SlurmdParameters=config_overrides) so that a plan's largest job, one CPU per process, can start.
set -euo pipefail

PACKAGES=(slurmctld slurmd munge slurm-client)

install() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v munged >/dev/null || missing+=(munge)
  command -v sbatch >/dev/null || missing+=(slurm-client)
  [ ${#missing[@]} -eq 0 ] && { echo "slurm: ${PACKAGES[*]} are installed"; return 0; }
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: ${missing[*]} missing and installing them needs root; run: sudo apt-get install ${PACKAGES[*]}" >&2
    return 1
  fi
  command -v apt-get >/dev/null || { echo "error: ${missing[*]} missing and there is no apt-get" >&2; return 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  }
  echo "slurm: installed ${missing[*]}"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_conf() {
  local dir=$1 cpus=$2 node
  node=$(hostname -s)
  local memory
  memory=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  cat >"$dir/slurm.conf" <<CONF
ClusterName=protocoltest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=bf_interval=1,sched_interval=1
MessageTimeout=30
KillWait=10
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  local dir=$1 cpus=${2:-16}
  mkdir -p "$dir"/{state,spool,munge}
  dir=$(cd "$dir" && pwd)
  chmod 700 "$dir/munge"
  write_conf "$dir" "$cpus"
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$dir/munge/munge.key"
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
  slurmctld -f "$dir/slurm.conf"
  slurmd -f "$dir/slurm.conf"
  export SLURM_CONF=$dir/slurm.conf
  for _ in $(seq 100); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qx idle; then
      echo "slurm: one-machine cluster up ($cpus CPUs), SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "error: the cluster in $dir did not come up within 20 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
  sinfo >&2 || true
  return 1
}

stop() {
  local dir=$1 pidfile pids=() pid
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null && pids+=("$pid")
  done
  for pid in "${pids[@]}"; do  # all asked at once; each gets 10 s before SIGKILL
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

case "${1:-}" in
  install) install ;;
  start) start "${2:?cluster folder}" "${3:-16}" ;;
  stop) stop "${2:?cluster folder}" ;;
  *) echo "usage: $0 install | start DIR [CPUS] | stop DIR" >&2; exit 2 ;;
esac
