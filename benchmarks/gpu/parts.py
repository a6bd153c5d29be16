"""The rows of the `reference` and `grid` parts, most valuable first (a part stops starting rows when its time
budget is spent, and lists the rest as not run, with their commands)."""

from __future__ import annotations

from rows import Row

REF_128, REF_1024, REF_8GIB = "experiment=sdxl_4090_128_bs8", "experiment=sdxl_4090_1024_bs8", \
    "experiment=sdxl_1024_bs1_8gib"

REFERENCE = [
    Row("ref_128_bs8", [REF_128], "SimpleTuner's RTX 4090 figure: 9237 MiB (20 steps)"),
    Row("ref_1024_bs8", [REF_1024], "SimpleTuner's RTX 4090 figure: 13102 MiB, 8 s/it (20 steps)"),
    Row("ref_1024_bs1_8gib", [REF_8GIB, "train.max_steps=10"], "the guide's untested claim: <= 8192 MiB"),
    Row("phases_128_bs8_kept", [REF_128, "train.max_steps=10"],
        "latent caching + validation decode first, encoders dropped without empty_cache", kind="phases",
        phases={"keep_reserved": 1, "image_size": 128, "images": 16}),
    Row("phases_128_bs8_empty_cache", [REF_128, "train.max_steps=10"],
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
                rows.append(Row(f"z{stage}_{offload}_512_bs{batch}",
                                [*GRID_BASE, f"zero_stage={stage}", f"offload={offload}", "resolution=512",
                                 f"train.batch_size={batch}"]))
    rows.append(Row("lora_1024_bs1", [*GRID_BASE, "adapter=lora", "zero_stage=2", "offload=none", "resolution=1024",
                                      "train.batch_size=1"], "LoRA on a frozen U-Net"))
    rows.append(Row("z2_cpu_512_bs1_no_ckpt", [*GRID_BASE, "zero_stage=2", "offload=cpu", "resolution=512",
                                               "train.batch_size=1", "train.gradient_checkpointing=false"],
                    "no gradient checkpointing"))
    return rows


GRID = grid_rows()
