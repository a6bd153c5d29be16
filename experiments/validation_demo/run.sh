#!/usr/bin/env bash
# The documentation's validation picture (docs/images/validation-grid.png), on a CPU: shapes and a VAE that draws them (make_data.py), then a tiny
# SDXL-shaped U-Net trained on them through zerotune with validation prompts every 200 steps, then one picture
# of the passes (progress.py). About 8 minutes on 2 cores. Usage: bash experiments/validation_demo/run.sh [out]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/outputs/validation_demo}
python=${PYTHON:-$root/.venv/bin/python}
"$python" "$here/make_data.py" "$out"
"$python" "$root/train.py" model=sdxl_tiny data=folder "data.path=$out/shapes" "model.components=$out/components" \
    "data.cache_dir=$out/cache" resolution.size=64 train.batch_size=16 train.max_steps=600 scheduler=constant \
    optimizer.lr=1e-3 checkpoint.final=false evaluate.enabled=false train.log_every=50 \
    'validation.prompts=["a red circle","a green square","a blue triangle"]' validation.every_n_steps=200 \
    validation.steps=25 validation.guidance_scale=4 "hydra.run.dir=$out/run"
"$python" "$here/progress.py" "$out/run" "$root/docs/images/validation-grid.png"
