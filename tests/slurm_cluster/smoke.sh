#!/usr/bin/env bash
# Check that the cluster from start.sh does what the tests rely on: the node is idle,
# srun runs 2 tasks at once, --gpus-per-node=4 sets CUDA_VISIBLE_DEVICES=0,1,2,3, and a job
# in the high-tier partition preempts (requeues) a job in the default one. ~30 s.
set -uo pipefail
W=$(mktemp -d)
cd "$W"
pass=0; fail=0
ok()  { echo "PASS: $*"; pass=$((pass + 1)); }
bad() { echo "FAIL: $*"; fail=$((fail + 1)); }
wait_gone() {  # jobid, timeout_s
  local t=0
  while [ $t -lt $(( $2 * 2 )) ]; do
    [ -z "$(squeue -h -j "$1" 2>/dev/null)" ] && return 0
    sleep 0.5; t=$((t + 1))
  done
  return 1
}
wait_state() {  # jobid, regex over "%T", timeout_s
  local t=0
  while [ $t -lt $(( $3 * 2 )) ]; do
    squeue -h -j "$1" -o '%T' 2>/dev/null | grep -Eq "$2" && return 0
    sleep 0.5; t=$((t + 1))
  done
  return 1
}

sinfo -h -n localhost -o '%T' | grep -q '^idle' && ok "sinfo: localhost idle" || bad "sinfo: $(sinfo -h -n localhost -o '%T')"

[ "$(srun -n 2 hostname | wc -l)" = 2 ] && ok "srun -n 2 hostname" || bad "srun -n 2 hostname"

G=$(sbatch --parsable --gpus-per-node=4 -o gpu.out --wrap 'echo $CUDA_VISIBLE_DEVICES')
if wait_gone "$G" 30 && [ "$(cat gpu.out)" = "0,1,2,3" ]; then ok "sbatch --gpus-per-node=4 -> $(cat gpu.out)"
else bad "sbatch --gpus-per-node=4 -> '$(cat gpu.out 2>/dev/null)'"; fi

CPUS=$(sinfo -h -n localhost -o '%c')
LOW=$(sbatch --parsable -p debug -n "$CPUS" -o low.out --open-mode=append --wrap 'trap "echo got-SIGTERM" TERM; sleep 300 & wait')
wait_state "$LOW" RUNNING 30
HIGH=$(sbatch --parsable -p urgent -n "$CPUS" -o high.out --wrap 'echo high-ran')
if wait_gone "$HIGH" 60 && grep -q high-ran high.out && scontrol show job "$LOW" | grep -q "Restarts=1"; then
  ok "urgent job preempted the debug job (requeued, Restarts=1)"
else
  bad "preemption: low=$(squeue -h -j "$LOW" -o '%T %r') high=$(squeue -h -j "$HIGH" -o '%T %r')"
fi
grep -q got-SIGTERM low.out && ok "preempted job got SIGTERM first" || bad "preempted job saw no SIGTERM"
scancel "$LOW" "$HIGH" 2>/dev/null

echo "$pass passed, $fail failed"
rm -rf "$W"
[ "$fail" = 0 ]
