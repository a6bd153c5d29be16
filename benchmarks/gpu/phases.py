"""A zerotune training run with the phases before training in the same process: latent caching (data=folder:
the VAE and both text encoders on the GPU), a validation pass (a VAE decode of one batch of latents), then
training. Answers "are blocks freed by an earlier phase kept reserved, and counted by nvidia-smi?".

    python benchmarks/gpu/phases.py [--dry-run] [--keep-reserved=1] [--image-size=128] -- <zerotune overrides>

The job runs in this process (a world of one rank, as under torchrun), so whatever the caching phase left in
torch's allocator is there when training starts. zerotune's own release of the encoders calls
torch.cuda.empty_cache(); --keep-reserved=1 drops the encoders without it (SimpleTuner moved them to the CPU and
kept its cache), which is the only change made to zerotune here. The validation pass is this script's own:
zerotune samples only class-conditional models. The components are SDXL-sized with random weights (built on
first use in the working folder; sdxl_tiny's tiny set in --dry-run), the images random noise.
Writes <run dir>/phases.json: memory after each phase, by torch and by NVML (None where not measured).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.helpers.tiny_components (the tokenizer files; the tiny set)

MIB = 2**20


class Sampler:
    """The device's used memory through NVML every 20 ms (this is the only process on the card), and its peak."""

    def __init__(self) -> None:
        self.peak, self.handle, self.nvml, self._stop = None, None, None, threading.Event()
        try:
            import pynvml
            import torch

            if torch.cuda.is_available():
                pynvml.nvmlInit()
                self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
                threading.Thread(target=self._loop, daemon=True).start()
        except Exception as exc:  # no NVML: nothing measured, said so in the file
            print(f"phases: NVML unavailable ({exc})", file=sys.stderr)

    def used_mib(self) -> float | None:
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MIB

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = self.used_mib()
            self.peak = used if self.peak is None else max(self.peak, used)
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()


def torch_mib() -> dict:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {"torch_allocated_mib": None, "torch_reserved_mib": None, "torch_max_allocated_mib": None,
                "torch_max_reserved_mib": None}
    return {"torch_allocated_mib": torch.cuda.memory_allocated() / MIB,
            "torch_reserved_mib": torch.cuda.memory_reserved() / MIB,
            "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
            "torch_max_reserved_mib": torch.cuda.max_memory_reserved() / MIB}


def patch_encoders(sampler: Sampler, marks: list, keep_reserved: bool) -> None:
    """Marks memory after caching, runs the validation pass, then releases the encoders (with or without
    torch.cuda.empty_cache()) and marks memory again."""
    import torch

    from zerotune.data.components import FrozenEncoders

    original_encode, original_release = FrozenEncoders.encode_images, FrozenEncoders.release

    def encode_images(self, pixels):
        latents = original_encode(self, pixels)
        self.kit_latent_shape = tuple(latents.shape)
        return latents

    def release(self):
        mark(marks, sampler, "after_caching")
        if self._vae is not None and getattr(self, "kit_latent_shape", None):
            with torch.no_grad():  # the validation pass: one batch of latents decoded to pixels
                self._vae.decode(torch.randn(self.kit_latent_shape, device=self.device))
            mark(marks, sampler, "after_validation_decode")
        if keep_reserved:
            self._vae = self._text = None  # freed into torch's cache, which keeps the blocks
        else:
            original_release(self)         # zerotune's: drops them, then torch.cuda.empty_cache()
        mark(marks, sampler, "after_release")

    FrozenEncoders.encode_images, FrozenEncoders.release = encode_images, release


def mark(marks: list, sampler: Sampler, phase: str) -> None:
    marks.append({"phase": phase, "nvml_device_used_mib": sampler.used_mib(), **torch_mib()})


def build_inputs(work: Path, image_size: int, images: int, dry_run: bool) -> tuple[Path, Path]:
    """The image folder (random noise, one caption each) and the components folder, made once per work folder."""
    import numpy as np
    from PIL import Image

    folder = work / f"images_{image_size}"
    if not folder.is_dir():
        folder.mkdir(parents=True)
        for i in range(images):
            pixels = np.random.default_rng(i).integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:03d}.png")
            (folder / f"{i:03d}.txt").write_text("a photo of a red dog\n")
    components = work / ("components_tiny" if dry_run else "components_sdxl")
    if not (components / "COMPLETE").is_file():
        if dry_run:
            from tests.helpers.tiny_components import save_tiny_pipeline

            save_tiny_pipeline(components)
        else:
            from sdxl_components import save_sdxl_pipeline

            save_sdxl_pipeline(components)
        (components / "COMPLETE").write_text("")
    return folder, components


def one_rank_world() -> None:
    """This process is the job's only rank: zerotune trains here instead of starting a worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--keep-reserved", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--images", type=int, default=16)
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")))
    folder, components = build_inputs(Path.cwd(), args.image_size, args.images, args.dry_run)
    overrides = [*overrides, "data=folder", f"data.path={folder}", f"model.components={components}",
                 f"data.cache_dir={run_dir}_latent_cache"]  # a fresh cache: every row runs the caching phase
    if args.dry_run:
        overrides.append(f"data.bucket_step={args.image_size}")
    sampler, marks = Sampler(), []
    plan = predict(overrides)
    patch_encoders(sampler, marks, bool(args.keep_reserved))
    one_rank_world()
    # zerotune's train ends the process through exiting.exit_now, which runs the atexit handlers first
    atexit.register(write_result, run_dir, sampler, marks, {"keep_reserved": bool(args.keep_reserved), "plan": plan})
    from zerotune.cli.command import main as zerotune

    try:
        zerotune(["train", *overrides])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def predict(overrides: list[str]) -> dict | None:
    """The planner's answer for this job on the card present, as summary.json writes it: in this one-process run,
    zerotune's parent (which records it in summary.json as plan.*) does not run."""
    from zerotune.config.errors import ConfigError
    from zerotune.plan.command_line import plan_one
    from zerotune.plan.guard import present_gpu

    try:
        return plan_one(overrides, present_gpu()).to_dict()
    except ConfigError as exc:
        print(f"phases: no plan: {exc}", file=sys.stderr)
        return None


def write_result(run_dir: Path, sampler: Sampler, marks: list, extra: dict) -> None:
    sampler.stop()
    mark(marks, sampler, "end")
    result = {**extra, "marks": marks, "nvml_device_peak_mib": sampler.peak}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "phases.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
