#!/usr/bin/env bash
# `zerotune tune` with warm workers on a card, then the same sweep with them off: whether forked workers train
# there, and what each trial's start to its first step costs either way. On the GPU machine, with .whl/ carried:
#   bash benchmarks/gpu/warm_tune.sh            # writes $OUT/warm_tune.md and each sweep's tune.md
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
WORKLOAD="model=tiny data=synthetic resolution=16 evaluate.enabled=false launch.num_processes=1
          zero_stage=0,2 offload=none train.batch_size=4,8 hydra.sweeper.global_batch=8"
for warm in true false; do
  SECONDS=0
  timeout ${TUNE_TIMEOUT_S:-150} python3 train.py -m hydra/sweeper=tune $WORKLOAD hydra.sweeper.warm_workers=$warm \
    hydra.sweep.dir=/tmp/warm-tune-$warm hydra.sweeper.name=warm_$warm > "$OUT/tune_warm_$warm.log" 2>&1
  echo "warm_workers=$warm: rc $? in ${SECONDS} s"
  cp /tmp/warm-tune-$warm/tune.md "$OUT/tune_warm_$warm.md" 2>/dev/null
done
python3 - "$OUT/warm_tune.md" <<'PY'
import json, sys
from pathlib import Path
rows = ["| warm_workers | job | config | worker_start | to first step s |", "|---|---|---|---|---|"]
for warm in ("true", "false"):
    for summary in sorted(Path(f"/tmp/warm-tune-{warm}").glob("*/summary.json"), key=lambda p: int(p.parent.name)):
        s = json.loads(summary.read_text())
        start = s.get("startup") or {}
        choices = s.get("choices") or {}
        config = " ".join(f"{k}={choices.get(k)}" for k in ("zero_stage", "batch_size", "grad_accum"))
        rows.append(f"| {warm} | {summary.parent.name} | {config} | {start.get('worker_start', 'unmeasured')} | "
                    f"{start.get('to_first_step_s', 'unmeasured')} |")
Path(sys.argv[1]).write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
