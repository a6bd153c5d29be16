"""The rows of the `first`, `reference`, `grid`, `loading` and `flux` parts, most valuable first (a part starts a row only
when its estimated seconds fit what is left of its time budget, and lists the rest as not run, with their
commands)."""

from __future__ import annotations

import estimates
from rows import Row

REF_128, REF_1024, REF_8GIB = "experiment=sdxl_4090_128_bs8", "experiment=sdxl_4090_1024_bs8", \
    "experiment=sdxl_1024_bs1_8gib"
REF_1024_NOTE = "SimpleTuner's RTX 4090 figure: 13102 MiB, 8 s/it"
REF_128_NOTE = "SimpleTuner's RTX 4090 figure: 9237 MiB"

# The first call's rows: the two reference rows, 10 steps each instead of 20, about 28 s sooner per row (10 x
# 2.65-2.93 s). zerotune's median leaves out its 5 warm-up steps, which leaves 5 timed; ZeRO-2 + CPU offload's step
# is steady by its third (9.93, 3.36, 2.88 s: grid-call1 z2_cpu_512_bs1), so the median is a steady one still. The
# memory peaks need no more steps: every recorded run's nvidia-smi peak was its loading phase, before any step.
FIRST = [
    Row("ref_1024_bs8", [REF_1024, "train.max_steps=10"], estimates.REF_1024_BS8, f"{REF_1024_NOTE} (10 steps)"),
    Row("ref_128_bs8", [REF_128, "train.max_steps=10"], estimates.REF_128_BS8, f"{REF_128_NOTE} (10 steps)"),
]

REFERENCE = [
    Row("ref_128_bs8", [REF_128], estimates.REF_128_BS8, f"{REF_128_NOTE} (20 steps)"),
    Row("ref_1024_bs8", [REF_1024], estimates.REF_1024_BS8, f"{REF_1024_NOTE} (20 steps)"),
    Row("ref_1024_bs1_8gib", [REF_8GIB, "train.max_steps=10"], estimates.REF_1024_BS1,
        "the guide's untested claim: <= 8192 MiB"),
    Row("phases_128_bs8_kept", [REF_128, "train.max_steps=10"], estimates.PHASES_128_BS8,
        "latent caching + validation decode first, encoders dropped without empty_cache", kind="phases",
        phases={"keep_reserved": 1, "image_size": 128, "images": 16}),
    Row("phases_128_bs8_empty_cache", [REF_128, "train.max_steps=10"], estimates.PHASES_128_BS8,
        "latent caching + validation decode first, torch.cuda.empty_cache() before training (zerotune's own)",
        kind="phases", phases={"keep_reserved": 0, "image_size": 128, "images": 16}),
]

# SDXL's full U-Net on synthetic latents, bf16, gradient checkpointing, AdamW: 3 steps are enough for the peak
# (step times come from the reference rows).
GRID_BASE = ["model=sdxl", "data=synthetic", "precision=bf16", "optimizer=adamw", "train.gradient_checkpointing=true",
             "train.max_steps=3", "train.log_every=1", "evaluate.enabled=false"]


def grid_rows() -> list[Row]:
    rows = []
    for batch in (1, 4):
        for stage in (2, 1, 3):
            for offload in ("cpu", "none"):
                name = f"z{stage}_{offload}_512_bs{batch}"
                rows.append(Row(name, [*GRID_BASE, f"zero_stage={stage}", f"offload={offload}", "resolution=512",
                                       f"train.batch_size={batch}"], grid_cost(name)))
    rows.append(Row("lora_1024_bs1", [*GRID_BASE, "adapter=lora", "zero_stage=2", "offload=none", "resolution=1024",
                                      "train.batch_size=1"], grid_cost("lora_1024_bs1"), "LoRA on a frozen U-Net"))
    rows.append(Row("z2_cpu_512_bs1_no_ckpt", [*GRID_BASE, "zero_stage=2", "offload=cpu", "resolution=512",
                                               "train.batch_size=1", "train.gradient_checkpointing=false"],
                    grid_cost("z2_cpu_512_bs1_no_ckpt"), "no gradient checkpointing"))
    return rows


def grid_cost(name: str) -> estimates.Cost:
    return estimates.GRID.get(name, estimates.GRID_UNRECORDED)


GRID = grid_rows()


# `loading`: does zerotune's loading peak now beat SimpleTuner's figures? SDXL's full U-Net, ZeRO-2 + CPU offload
# (the reference rows as `first` runs them, 10 steps): DeepSpeed 0.19.8's ZeRO-1/2 flatten the whole optimizer
# group on the card and clone the partition there, which made every recorded run's peak its loading phase (16,278 /
# 16,602 MiB on the H100). deepspeed.param_groups=K cuts the U-Net into K contiguous groups, flattened one at a
# time; K=1 is the old behaviour, 16 what `auto` takes at ZeRO-1/2. The K=16 rows come first: they answer the part's
# question, and K=1's peaks are recorded twice already (the H100, the H200: within 6 MiB); K=1 again on the same
# card is the control. The estimates are K=1's records (K=16's loading is unmeasured).
K1, K16 = "deepspeed.param_groups=1", "deepspeed.param_groups=16"
STEPS_10 = "train.max_steps=10"
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
LOADING = [
    # 1. the two reference rows at K=16, then at K=1
    Row("ref_128_bs8_k16", [REF_128, STEPS_10, K16], estimates.REF_128_BS8,
        f"{REF_128_NOTE}; K=16", against="ref_128_bs8_k1"),
    Row("ref_1024_bs8_k16", [REF_1024, STEPS_10, K16], estimates.REF_1024_BS8,
        f"{REF_1024_NOTE}; K=16", against="ref_1024_bs8_k1"),
    Row("ref_128_bs8_k1", [REF_128, STEPS_10, K1], estimates.REF_128_BS8, f"{REF_128_NOTE}; K=1 (before)"),
    Row("ref_1024_bs8_k1", [REF_1024, STEPS_10, K1], estimates.REF_1024_BS8, f"{REF_1024_NOTE}; K=1 (before)"),
    # 2. zerotune's cheapest configuration for the same job: ZeRO-3, parameters and optimizer on the host, and
    # the 1e8 reduce bucket that takes the planner's figure from 10,434 to 8,678 MiB on an rtx4090
    Row("z3_params_cpu_1024_bs8", [REF_1024, STEPS_10, "zero_stage=3", "offload=cpu", "offload.params=true",
                                   "deepspeed.reduce_bucket_size=100000000"],
        estimates.Z3_PARAMS_1024_BS8, "ZeRO-3, parameters and optimizer states on the host, reduce bucket 1e8; "
        "1024² batch 8", against="ref_1024_bs8_k16"),
    # 3. as the budget allows: the guide's 8 GiB claim; the 128² row with expandable segments; smaller buckets
    Row("ref_1024_bs1_k16", [REF_8GIB, STEPS_10, K16], estimates.REF_1024_BS1,
        "the guide's untested claim: <= 8192 MiB at 1024² batch 1 (buckets 2e8); K=16"),
    Row("ref_128_bs8_k16_expandable", [REF_128, STEPS_10, K16], estimates.REF_128_BS8,
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; K=16", env=EXPANDABLE, against="ref_128_bs8_k16"),
    Row("ref_128_bs8_k16_bucket1e8", [REF_128, STEPS_10, K16, "deepspeed.reduce_bucket_size=100000000"],
        estimates.REF_128_BS8, "reduce bucket 1e8 (default 5e8): its s/step against the default's; K=16",
        against="ref_128_bs8_k16"),
    Row("ref_128_bs8_k16_bucket2e8", [REF_128, STEPS_10, K16, "deepspeed.reduce_bucket_size=200000000"],
        estimates.REF_128_BS8, "reduce bucket 2e8 (default 5e8): its s/step against the default's; K=16",
        against="ref_128_bs8_k16"),
]


# `flux`: the diffusion transformers on a card, with random weights and the real shapes, ZeRO-3 with the parameters
# and optimizer states on the host, 1024² batch 1, bf16, gradient checkpointing, 3 steps. The lent machine's host has
# 128 GiB: FLUX.1's full fine-tune needs about 280 GiB of it (its plan: fp32 master weights and Adam's states,
# 11.9B each, pinned), so that row runs with plan.guard=skip and is recorded as the guard's skip with the plan's
# figures; its LoRA (the base frozen on the host, 44.8M trained) and SD3.5 Medium's full fine-tune fit and train.
FLUX_BASE = ["data=synthetic", "precision=bf16", "resolution=1024", "train.batch_size=1",
             "train.gradient_checkpointing=true", "train.max_steps=3", "train.log_every=1", "zero_stage=3",
             "offload=cpu", "offload.params=true"]
FLUX = [
    Row("flux_lora_z3_cpu_1024_bs1", ["model=flux", "adapter=lora", *FLUX_BASE], estimates.FLUX_LORA,
        "FLUX.1-dev's transformer, LoRA rank 16 on attention and MLPs"),
    Row("sd35_medium_z3_cpu_1024_bs1", ["model=sd35_medium", *FLUX_BASE], estimates.SD35_MEDIUM,
        "SD3.5 Medium's transformer, full fine-tune"),
    Row("flux_full_z3_cpu_1024_bs1", ["model=flux", *FLUX_BASE, "plan.guard=skip"], estimates.FLUX_SKIPPED,
        "FLUX.1-dev full: predicted above the host's memory, skipped by the guard"),
]
