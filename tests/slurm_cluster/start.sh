#!/usr/bin/env bash
# Start a single-node Slurm cluster on localhost for the project's tests: munged, slurmctld
# and slurmd run directly (no systemd), the node declares CPUs=8 and 4 fake GPUs whatever
# the machine has, and two partitions of different PriorityTier share the node so that
# preemption (PreemptMode=REQUEUE after a GraceTime) can be tested against a real Slurm.
#
# Idempotent: if the daemons are up with this exact configuration and the node is idle, it
# changes nothing; otherwise it stops whatever it started before and starts afresh.
# Needs root (it writes /etc/slurm and starts daemons). Installs Debian's packages if missing.
#
# Knobs: SLURM_FAKE_CPUS (8), SLURM_FAKE_GPUS (4; 0 = none), SLURM_GRACE_TIME_S (10),
#        SLURM_START_TIMEOUT_S (60), SLURM_SKIP_APT=1 (never run apt-get).
set -euo pipefail

FAKE_CPUS="${SLURM_FAKE_CPUS:-8}"
FAKE_GPUS="${SLURM_FAKE_GPUS:-4}"
GRACE_TIME_S="${SLURM_GRACE_TIME_S:-10}"
TIMEOUT_S="${SLURM_START_TIMEOUT_S:-60}"
NODE=localhost            # the host name is not the node name here; jobs see this one
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm-autosp-test   # pid files, fake GPU device nodes, config fingerprint
HERE="$(cd "$(dirname "$0")" && pwd)"
T0=$(date +%s.%N)

log() { echo "[slurm_cluster/start $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%5.1fs", b-a}')] $*"; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (writes $CONF_DIR, starts daemons); try: sudo $0"

# ------------------------------------------------------------------ install if missing
PKGS="munge slurmctld slurmd slurm-client"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  [ "${SLURM_SKIP_APT:-0}" = 1 ] && die "packages missing:$missing (and SLURM_SKIP_APT=1)"
  log "installing:$missing (apt-get update first)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # A policy-rc.d that exits 101 keeps postinst from starting the services: we start them.
  apt-get install -y -q --no-install-recommends $missing >/dev/null
  log "installed $(slurmctld -V)"
fi

# ------------------------------------------------------------------ desired configuration
GRES_LINE=""
[ "$FAKE_GPUS" -gt 0 ] && GRES_LINE="Gres=gpu:${FAKE_GPUS}"

SLURM_CONF="ClusterName=autosp-test
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
GresTypes=gpu
NodeName=$NODE NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$FAKE_CPUS RealMemory=8000 $GRES_LINE State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME_S
PartitionName=urgent Nodes=$NODE Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"

# Fake GPUs: slurmd drops GPUs without a File=, so each gets a character device (1:3, the
# same as /dev/null); AutoDetect=off keeps slurmd away from NVML.
GRES_CONF="AutoDetect=off"
if [ "$FAKE_GPUS" -gt 0 ]; then
  GRES_CONF="$GRES_CONF
NodeName=$NODE Name=gpu File=$RUN_DIR/fakegpu[0-$((FAKE_GPUS - 1))]"
fi

FINGERPRINT=$(printf '%s\n%s\n' "$SLURM_CONF" "$GRES_CONF" | sha256sum | cut -d' ' -f1)

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_state() { sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true; }

if [ "$(cat "$RUN_DIR/fingerprint" 2>/dev/null || true)" = "$FINGERPRINT" ] \
   && alive /run/munge/munged.pid && alive "$RUN_DIR/slurmctld.pid" && alive "$RUN_DIR/slurmd.pid"; then
  case "$(node_state)" in
    idle*|mixed*|allocated*) log "already running with this configuration; nothing to do"; sinfo; exit 0 ;;
  esac
fi

# ------------------------------------------------------------------ fresh start
"$HERE/stop.sh" >/dev/null 2>&1 || true
mkdir -p "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" /var/spool/slurmctld /var/spool/slurmd
printf '%s\n' "$SLURM_CONF" > "$CONF_DIR/slurm.conf"
printf '%s\n' "$GRES_CONF" > "$CONF_DIR/gres.conf"
for i in $(seq 0 $((FAKE_GPUS - 1))); do
  rm -f "$RUN_DIR/fakegpu$i"
  mknod -m 666 "$RUN_DIR/fakegpu$i" c 1 3
done

mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
chmod 0755 /run/munge
chmod 0700 /etc/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then   # Debian's postinst normally creates one
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged --force
for _ in $(seq 1 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
munge -n </dev/null | unmunge >/dev/null || die "munged does not answer; see /var/log/munge/munged.log"
log "munged up (pid $(cat /run/munge/munged.pid))"

slurmctld -c          # forks; -c: start clean, forget jobs of a previous instance
slurmd -N "$NODE"     # forks; -N: the node name differs from the host name
log "slurmctld (pid $(cat "$RUN_DIR/slurmctld.pid")) and slurmd (pid $(cat "$RUN_DIR/slurmd.pid")) started"

deadline=$(( $(date +%s) + TIMEOUT_S ))
state=""
while [ "$(date +%s)" -lt "$deadline" ]; do
  state=$(node_state)
  case "$state" in idle*) break ;; esac
  sleep 0.5
done
case "$state" in
  idle*) ;;
  *) tail -n 30 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
     die "node $NODE not idle after ${TIMEOUT_S}s (state '${state:-none}'); logs above" ;;
esac
echo "$FINGERPRINT" > "$RUN_DIR/fingerprint"
log "node $NODE idle: cluster ready (CPUs=$FAKE_CPUS, GPUs=$FAKE_GPUS, GraceTime=${GRACE_TIME_S}s)"
sinfo
