"""ZeRO-3 builds the U-Net under deepspeed.zero.Init: each rank holds only its partition from construction, with
the same initial weights (so the same losses) as the plain build of stages 0-2, `model.pretrained` loaded into
the partitions, and the EMA taken from the gathered weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.cli import ROOT, cli_env, read_losses, read_summary, run_cli

# One process (gloo, world 1). argv: out folder, "zero" (the zero.Init build) or "plain" (zero.Init turned
# off: the build before it, partitioned by the engine), and optional overrides.
PROBE = textwrap.dedent("""
    import json, sys, torch
    from tests.helpers.cli import compose_cfg
    from zerotune.train import distributed
    distributed.ensure_single_process_env()
    import deepspeed
    from accelerate.utils import set_seed
    from zerotune.rundir.loggers import NullLogger
    from zerotune.models import build_network
    from tests.helpers.cli import preflight
    from zerotune.rundir import RunDir
    from zerotune.train import trainer as trainer_module

    out, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    overrides = ["zero_stage=3", "train.batch_size=4", "ema.enabled=true", "ema.warmup=false", "ema.decay=0.5",
                 "precision=fp32", "scheduler=constant", "checkpoint.final=false", *extra]
    cfg = compose_cfg(*overrides)
    built = {}
    real_build = trainer_module.build_network

    def recording_build(model_cfg, zero_init=None):
        unet = real_build(model_cfg, zero_init=zero_init)
        # What this rank holds right after construction, before DeepSpeed's engine exists.
        built["partitioned"] = [hasattr(p, "ds_numel") and p.ds_tensor is not None and p.data.numel() == 0
                                for p in unet.parameters()]
        built["numel"] = sum(getattr(p, "ds_numel", p.numel()) for p in unet.parameters())
        return unet

    trainer_module.build_network = recording_build
    if mode == "plain":
        trainer_module.zero3_init = lambda accelerator, checked: None
    t = trainer_module.Trainer(preflight(cfg, 1), RunDir(out), NullLogger())
    params = list(t.unet_module().named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        initial = {n: p.detach().clone() for n, p in params}
    ema_initial = {n: v.clone() for n, v in t.ema.shadow.items()}
    losses = [t.train_step()["loss/train"] for _ in range(3)]
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        final = {n: p.detach().clone() for n, p in params}
    t.accelerator.end_training()
    set_seed(cfg.train.seed)  # the trainer's RNG state when it builds the U-Net
    reference = dict(build_network(cfg.model).named_parameters())
    torch.save({"initial": initial, "final": final, "ema_initial": ema_initial, "ema": t.ema.shadow,
                "reference": {n: p.detach() for n, p in reference.items()}}, f"{out}/weights.pt")
    json.dump({"losses": losses, **built}, open(f"{out}/probe.json", "w"))
""")


def _probe(out, mode: str, *overrides: str) -> tuple[dict, dict]:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out), mode, *overrides], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "probe.json").read_text()), torch.load(out / "weights.pt", weights_only=False)


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zero3_builds_partitioned_with_the_plain_init_losses_and_ema(tmp_path):
    zero, zero_w = _probe(tmp_path / "zero", "zero")
    plain, plain_w = _probe(tmp_path / "plain", "plain")
    assert zero["partitioned"] and all(zero["partitioned"]), "every parameter is a ZeRO-3 partition when built"
    assert not any(plain["partitioned"])  # zero.Init off: built whole, partitioned only by the engine
    assert zero["numel"] == plain["numel"]
    # The same seeded RNG stream: the same initial weights as the plain build, so the same losses and weights.
    assert _equal(zero_w["initial"], zero_w["reference"])
    assert _equal(zero_w["initial"], plain_w["initial"])
    assert zero["losses"] == plain["losses"]
    assert _equal(zero_w["final"], plain_w["final"])
    # The EMA starts from the gathered weights and averages the gathered ones (decay 0.5, no warm-up).
    assert _equal(zero_w["ema_initial"], zero_w["initial"])
    assert _equal(zero_w["ema"], plain_w["ema"])
    assert not _equal(zero_w["ema"], zero_w["ema_initial"])


# The U-Net built under zero.Init (world 1) from each override set in argv[2:] (space-separated, naming
# `model.pretrained`), its gathered weights saved.
LOAD = textwrap.dedent("""
    import sys, torch
    from tests.helpers.cli import compose_cfg
    from zerotune.train import distributed
    distributed.ensure_single_process_env()
    import deepspeed
    from zerotune.models import build_network

    deepspeed.init_distributed(dist_backend="gloo")
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    loaded, draws = [], []
    for overrides in sys.argv[2:]:
        torch.manual_seed(0)
        unet = build_network(compose_cfg(*overrides.split()).model, zero_init=deepspeed.zero.Init(config_dict_or_path=ds))
        draws.append(torch.randn(4))  # what draws next (peft's LoRA init) gets
        params = list(unet.named_parameters())
        assert all(p.data.numel() == 0 for _, p in params)
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            loaded.append({n: p.detach().clone() for n, p in params})
    torch.save((loaded, draws), sys.argv[1])
""")


def test_zero3_loads_pretrained_into_the_partitions(tmp_path):
    """A .safetensors state dict, a diffusers folder and an original-layout single file (SDXL-shaped), each
    loaded module by module into the partitions; each build leaves the global RNG where the plain build leaves
    it (so LoRA's init matches the other stages')."""
    import torch
    from safetensors.torch import save_file

    from tests.helpers.cli import compose_cfg
    from tests.helpers.original_layout import write_checkpoint
    from zerotune.models import build_network

    sources = {}
    for model in ("tiny", "sdxl_tiny"):
        torch.manual_seed(123)
        sources[model] = build_network(compose_cfg(f"model={model}", "data=synthetic").model)
        with torch.no_grad():
            for p in sources[model].parameters():
                p.add_(torch.randn_like(p))  # not the seeded init a run would make anyway
    save_file(sources["tiny"].state_dict(), str(tmp_path / "unet.safetensors"))
    sources["tiny"].save_pretrained(tmp_path / "folder")
    write_checkpoint(sources["sdxl_tiny"], tmp_path / "sdxl.safetensors")
    runs = [f"model.pretrained={tmp_path / 'unet.safetensors'}", f"model.pretrained={tmp_path / 'folder'}",
            f"model=sdxl_tiny data=synthetic model.pretrained={tmp_path / 'sdxl.safetensors'}"]
    proc = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "loaded.pt"), *runs],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, draws = torch.load(tmp_path / "loaded.pt", weights_only=False)
    for run, weights, source in zip(runs, loaded, ("tiny", "tiny", "sdxl_tiny"), strict=True):
        assert _equal(weights, {n: p.detach() for n, p in sources[source].named_parameters()}), run
    for run, draw in zip(runs, draws, strict=True):
        torch.manual_seed(0)
        build_network(compose_cfg(*run.split()).model)
        assert torch.equal(draw, torch.randn(4)), run


@pytest.mark.slow
def test_zero3_two_ranks_match_stage2_and_hold_half_the_parameters(tmp_path):
    """Two processes: zero.Init partitions across both ranks; the losses are stage 2's."""
    losses = {}
    for stage in (2, 3):
        run = tmp_path / f"stage{stage}"
        proc = run_cli(f"zero_stage={stage}", "launch.num_processes=2", "train.batch_size=4", "train.max_steps=4",
                       "train.log_every=1", "evaluate.enabled=false", "precision=fp32", "scheduler=constant",
                       "ema.enabled=true", "checkpoint.final=false", "deepspeed.stage3_param_persistence_threshold=0",
                       f"hydra.run.dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[stage] = read_losses(run)
    assert losses[3] == pytest.approx(losses[2], rel=1e-5)
    partition = read_summary(tmp_path / "stage3")["partition"]
    assert 0 < partition["params_bytes"] < 0.6 * read_summary(tmp_path / "stage2")["partition"]["params_bytes"]


# Each rank's growth of its peak RSS (ru_maxrss) while it builds the U-Net under zero.Init, in MiB, as JSON.
BUILD_PEAK = textwrap.dedent("""
    import json, resource, sys
    import deepspeed, diffusers, peft, torch
    from tests.helpers.cli import compose_cfg
    from zerotune.models import build_network
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = compose_cfg(*sys.argv[2:])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    build_network(cfg.model, zero_init=deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                                             "zero_optimization": {"stage": 3}}))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    open(f"{sys.argv[1]}.{torch.distributed.get_rank()}", "w").write(json.dumps(grown))
""")


@pytest.mark.slow
def test_planner_zero3_build_term_matches_the_measured_build_peak(tmp_path):
    """A 164 M-parameter U-Net (sdxl_tiny's blocks, wider) on 2 ranks: the planner's `model_load` at ZeRO-3 (the
    rank's partition + one module whole) against each rank's measured peak growth over the build, within ±10%.
    glibc's dynamic mmap threshold would let the freed whole modules fragment the heap (about 25% more here:
    memory the allocator keeps, not tensors); a fixed threshold measures what the build holds."""
    overrides = ["model=sdxl_tiny", "model.unet.block_out_channels=[320,640,640]", "zero_stage=3", "precision=fp32",
                 "launch.num_processes=2", "resolution=64"]
    proc = run_cli("plan", "--json", *overrides, module="zerotune")
    assert proc.returncode == 0, proc.stderr[-2000:]
    predicted = {t["term"]: t["mib"] for t in json.loads(proc.stdout)["host_terms"]}["model_load"]
    out, script = tmp_path / "grown", tmp_path / "build_peak.py"
    script.write_text(BUILD_PEAK)
    env = {**cli_env(), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(out), *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"grown.{rank}").read_text())
        assert 0.9 <= measured / predicted <= 1.1, f"rank {rank}: measured {measured:.0f} MiB, predicted {predicted:.0f}"
