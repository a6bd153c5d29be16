"""Can `zerotune tune`'s warm workers run on a card? (job/warm.py)

The template imports what every worker imports, then forks one worker per trial. A forked child can use CUDA only
if its parent never initialised the CUDA driver. This imports exactly what the template imports, in a fresh
interpreter, says whether the driver or torch's CUDA state was initialised by that, then forks a child that
trains a small layer on the card for a few steps and reports its exit status.

    python benchmarks/gpu/fork_probe.py          # prints one JSON line per case
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CASE = r"""
import json, os, sys, time
t0 = time.perf_counter()
from zerotune.job.warm import import_worker_modules
import torch
# the template's imports (job/warm.py serve); deepspeed_too: what it imports on a CPU-only torch as well
import_worker_modules(setup_too=sys.argv[1] == "deepspeed_too")
imports_s = time.perf_counter() - t0
maps = open("/proc/self/maps").read()
state = {"imports_s": round(imports_s, 2), "torch_cuda_initialized": torch.cuda.is_initialized(),
         "libcuda_mapped": "libcuda.so" in maps}
if sys.argv[1] == "device_count_first":  # what a template would do if it asked for the card count itself
    state["device_count"] = torch.cuda.device_count()
    state["libcuda_mapped_after_count"] = "libcuda.so" in open("/proc/self/maps").read()
pid = os.fork()
if pid == 0:
    try:
        layer = torch.nn.Linear(1024, 1024, device="cuda")
        opt = torch.optim.AdamW(layer.parameters())
        for _ in range(5):
            loss = layer(torch.randn(64, 1024, device="cuda")).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
        os._exit(0)
    except BaseException as exc:
        print(f"child: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
_, status = os.waitpid(pid, 0)
state["child_exit"] = os.waitstatus_to_exitcode(status)
print(json.dumps(state))
"""


def main() -> int:
    failed = 0
    for case, nvml in (("imports_only", "0"), ("device_count_first", "1"), ("device_count_first", "0"),
                       ("deepspeed_too", "1")):
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": nvml}
        proc = subprocess.run([sys.executable, "-c", CASE, case], env=env, capture_output=True, text=True,
                              timeout=120)
        line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        result = {"case": case, "PYTORCH_NVML_BASED_CUDA_CHECK": nvml, "rc": proc.returncode,
                  **json.loads(line), "stderr_tail": proc.stderr.strip()[-400:]}
        failed += result.get("child_exit") != 0
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
