#!/usr/bin/env bash
# GPU evidence for the memory plan, in one command: the probe (python -m slurm_autosp.probe) on
# one GPU at SP=1, an 8B-wide model (configs/llama8b_32k.yaml shapes, LAYERS decoder layers),
# sequences doubling from 16k under each checkpointing policy (none, sac at budget 0, full)
# until out of memory. Prints, per run, the plan's memory against the measured peak, step time
# and MFU, then the longest sequence each policy trained.
#
#   bench/gpu_check.sh                      # about 8 minutes; the same on a node of 8 GPUs (one is used)
#   LAYERS=8 DEADLINE_S=900 bench/gpu_check.sh
#
# The plan is told the GPU is huge (cluster.gpu_memory_gb=100000) so that it never refuses a
# run: the GPU's allocator decides where each policy stops, and the plan's prediction is printed
# beside it. Each policy gets an equal share of DEADLINE_S; a run that would not finish in its
# share is not started and is reported as such. Logs and probe.json files go to OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

LAYERS=${LAYERS:-4}
DEADLINE_S=${DEADLINE_S:-480}
OUT=${OUT:-runs/gpu_check}
SEQS=(16384 32768 65536 131072 262144 524288)
POLICIES=("none" "sac_budget_0" "full")

fail() {
    echo "gpu_check: $*" >&2
    exit 1
}

command -v nvidia-smi >/dev/null 2>&1 ||
    fail "no GPU visible: nvidia-smi is not installed here; run this on a GPU node (e.g. srun --gpus=1 bench/gpu_check.sh)"
nvidia-smi -L >/dev/null 2>&1 || fail "no GPU visible: nvidia-smi -L lists no GPU"
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    fail "no GPU visible to torch: torch.cuda.is_available() is False (a CPU build of torch? see TORCH_SPEC in install.sh)"

mkdir -p "$OUT"
echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i 0), $LAYERS layers of Llama-3.1-8B width, SP=1, ZeRO-1, bf16; output in $OUT"
printf '%-14s %8s %12s %12s %8s %9s %7s  %s\n' policy seq plan_GB peak_GB error step_s MFU result

policy_args() {
    case "$1" in
    none) echo "compile.activation_checkpointing=none" ;;
    sac_budget_0) echo "compile.activation_checkpointing=sac compile.activation_memory_budget=0" ;;
    full) echo "compile.activation_checkpointing=full" ;;
    esac
}

declare -A LONGEST
share=$((DEADLINE_S / ${#POLICIES[@]}))
for policy in "${POLICIES[@]}"; do
    LONGEST[$policy]="none trained"
    policy_start=$SECONDS
    last=0
    for seq in "${SEQS[@]}"; do
        left=$((share - (SECONDS - policy_start)))
        # attention grows with S^2: a doubled sequence takes up to 4x the last run's time
        if ((left < 30 || last * 3 > left)); then
            printf '%-14s %8s %s\n' "$policy" "$seq" "not started: ${left}s left of this policy's ${share}s"
            break
        fi
        name="${policy}_${seq}"
        log="$OUT/${name}.log"
        started=$SECONDS
        # shellcheck disable=SC2046  # policy_args is a list of key=value words
        timeout "$left" python -m slurm_autosp.probe cfg=configs/llama8b_32k.yaml \
            cluster.backend=local cluster.gpus_per_node=1 cluster.gpu_memory_gb=100000 \
            parallel.sp_size=1 parallel.zero_stage=1 train.grad_accum=1 train.micro_batch=1 \
            data.seq_len="$seq" probe.steps=2 probe.layers="$LAYERS" \
            compile.tile_tokens=0 compile.offload_activations=false $(policy_args "$policy") \
            run.output_root="$OUT" run.name="$name" follow=true >"$log" 2>&1 || true
        last=$((SECONDS - started))
        result=$(python - "$OUT/${name}_probe/probe.json" "$log" <<'EOF'
import json, sys
from pathlib import Path

report, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text(errors="replace")
if not report.exists():
    oom = "OutOfMemoryError" in log or "out of memory" in log
    print("oom" if oom else "failed", "-", "-", "-", "-", "-", "out of memory before the steps" if oom else "no probe.json, see the log")
    sys.exit()
r = json.loads(report.read_text())
rank, plan = r["ranks"][0], r["plan"]
peak = rank["peak_bytes"]
error = f"{peak / plan['subtotal'] - 1:+.1%}" if plan else "-"
mfu = f"{rank['mfu']:.1%}" if rank["mfu"] is not None else "-"
status = "oom" if rank["oom"] else "ok"
print(status, f"{plan['subtotal'] / 1e9:.2f}" if plan else "-", f"{peak / 1e9:.2f}", error, f"{rank['step_s']:.3f}", mfu, rank["oom"] or "trained")
EOF
        )
        read -r status plan_gb peak_gb error step_s mfu detail <<<"$result"
        printf '%-14s %8s %12s %12s %8s %9s %7s  %s\n' "$policy" "$seq" "$plan_gb" "$peak_gb" "$error" "$step_s" "$mfu" "$detail"
        if [[ $status != ok ]]; then
            break
        fi
        LONGEST[$policy]=$seq
    done
done

echo "longest sequence trained ($LAYERS layers, one GPU, SP=1):"
for policy in "${POLICIES[@]}"; do
    printf '  %-14s %s\n' "$policy" "${LONGEST[$policy]}"
done
