"""The memory planner's commands and rules: GPU names, the allocator model, the ranking, plan.only jobs,
the guard on a (faked) CUDA device, and bad input. The guard on a CPU accelerator: tests/test_host_guard.py."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.cli import call_main, read_summary, run_cli
from zerotune.cli.plan import main as plan_main
from zerotune.config.errors import ConfigError
from zerotune.plan import allocator, command_line, gpus
from zerotune.plan import gpus as recommend
from zerotune.plan import guard as planning
from zerotune.rundir.plan import Plan

MIB = 2**20


# ------------------------------------------------------------------------------------------ GPU names


@pytest.mark.parametrize("name", ["rtx3090", "rtx4090", "l4", "l40s", "a100-40", "a100-80", "h100", "h200"])
def test_every_card_a_user_types_is_known(name):
    card = gpus.lookup(name.upper())
    assert card.name == name and card.memory_mib > 20_000 and card.bf16_tflops > 0


def test_an_unknown_card_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as err:
        gpus.lookup("rtx5090", key="--gpu")
    assert err.value.key == "--gpu" and "rtx4090" in err.value.fix and "--gpu-mib" in err.value.fix
    with pytest.raises(ConfigError) as err:
        gpus.lookup("rtx5090")
    assert err.value.key == "plan.gpu"


@pytest.mark.parametrize("mib", [-5, 0])
def test_a_card_memory_must_be_positive(mib):
    with pytest.raises(ConfigError) as err:
        gpus.lookup(None, mib, key="--gpu")
    assert err.value.key == "--gpu-mib"


def test_a_budget_alone_is_a_card_without_throughput():
    card = gpus.lookup(None, 12288)
    assert card.memory_mib == 12288 and card.bf16_tflops == 0.0


# ------------------------------------------------------------------------------------------ allocator


@pytest.mark.parametrize(("sizes", "reserved"), [
    ([1], 2 * MIB),                              # one byte: a 512 B block in a 2 MiB small segment
    ([600 * 1024] * 3, 2 * MIB),                 # 1.76 MiB of small blocks share one segment
    ([600 * 1024] * 4, 4 * MIB),                 # 2.34 MiB need two
    ([5 * MIB], 20 * MIB),                       # 1-10 MiB: cut from a 20 MiB segment
    ([5 * MIB] * 4, 20 * MIB),                   # four of them fill it
    ([11 * MIB], 12 * MIB),                      # large: its own segment, rounded to 2 MiB
    ([11 * MIB + 1], 12 * MIB),
    ([], 0),
])
def test_caching_allocator_rules(sizes, reserved):
    assert allocator.reserved_bytes(sizes) == reserved


# ------------------------------------------------------------------------------------------ ranking


def _row(stage, offload, checkpointing, peak, host=1.0):
    plan = Plan.made(gpu_peak_mib=peak, host_peak_mib=host, nvme_mib=0.0, time_floor_s=0.1, bound="compute")
    return recommend.Row(stage, offload, checkpointing, plan)


def test_the_lowest_stage_that_fits_is_recommended_and_why():
    card = gpus.lookup("rtx4090")
    rows = [_row(0, "none", False, 40_000), _row(1, "none", True, 26_000), _row(2, "cpu", True, 13_000),
            _row(2, "none", False, 23_000), _row(3, "cpu", False, 9_000),
            recommend.Row(1, "nvme", False, None, refused="`offload`: NVMe needs stage 3")]
    answer = recommend.rank(rows, card)
    assert answer["recommended"]["option"] == "zero_stage=2 offload=none gradient_checkpointing=false"
    assert "stage 1 needs at least 26,000 MiB" in answer["recommended"]["why"]
    assert [r["fits"] for r in answer["options"]][:3] == [True, True, True]
    assert answer["options"][-1]["refused"]
    # beside the recommendation, the option with the least memory, whatever its stage and offload
    assert answer["smallest"] == {"option": "zero_stage=3 offload=cpu gradient_checkpointing=false",
                                  "peak_mib": 9_000, "time_floor_s": 0.1}
    assert "smallest peak: zero_stage=3 offload=cpu gradient_checkpointing=false (9,000 MiB, time floor 0.100 " \
        "s/step)" in command_line.ranking({"micro_batch": None, **answer})


def test_a_host_budget_ranks_by_the_host_too():
    """FLUX.1 on an rtx4090: only ZeRO-3 with offload fits the card, and it needs ~280 GiB of host memory. Without
    plan.host_mib the card decides and the recommendation says what the host needs; with it, too much is no fit."""
    rows = [_row(3, "cpu", True, 7_750, host=286_900), _row(3, "none", True, 208_114, host=23_674)]
    card = gpus.lookup("rtx4090")
    by_card = recommend.rank(rows, card)
    assert by_card["recommended"]["option"] == "zero_stage=3 offload=cpu gradient_checkpointing=true"
    assert "it needs 286,900 MiB of host memory (plan.host_mib=<MiB>" in by_card["recommended"]["why"]
    budget = recommend.rank(rows, card, host_mib=131_072)
    assert budget["recommended"]["option"] is None and budget["options"][0]["fits"] is False
    assert "nothing fits rtx4090 (24,564 MiB) and 131,072 MiB of host memory" in budget["recommended"]["why"]


def test_plan_all_reads_the_host_budget_from_the_overrides():
    assert command_line.host_budget(["plan.host_mib=65536"]) == 65536.0
    assert command_line.host_budget([]) is None


def test_nothing_fits_says_so_with_the_smallest():
    answer = recommend.rank([_row(2, "cpu", True, 30_000), _row(3, "cpu", True, 25_000)], gpus.lookup("rtx4090"))
    assert answer["recommended"]["option"] is None
    assert "nothing fits rtx4090" in answer["recommended"]["why"] and "25,000 MiB" in answer["recommended"]["why"]


# ------------------------------------------------------------------------------------------ guard (fake CUDA)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device with 1 GiB free, for the guard's code path on this CPU-only torch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1024 * MIB, 24564 * MIB))


def _cfg(guard):
    return OmegaConf.create({"plan": {"guard": guard, "gpu": None, "gpu_mib": None, "host_mib": None}})


def test_guard_on_a_gpu_with_too_little_free_memory(fake_cuda, caplog):
    plan = Plan.made(gpu_peak_mib=5000.0)
    assert planning.guard(_cfg("warn"), plan) is None
    assert "above the 1,024 MiB free" in caplog.text
    assert planning.guard(_cfg("skip"), plan) == "predicted_oom"
    with pytest.raises(ConfigError) as err:
        planning.guard(_cfg("refuse"), plan)
    assert err.value.key == "plan.guard"
    assert planning.guard(_cfg("refuse"), Plan.made(gpu_peak_mib=900.0)) is None


def test_guard_without_a_gpu_or_host_figures_has_nothing_to_do():
    # On this CPU-only torch the device's share is guarded through the plan's host_fit (tests/test_host_guard.py).
    assert planning.guard(_cfg("refuse"), Plan.made(gpu_peak_mib=10**9)) is None


def test_guard_on_a_gpu_host_checks_the_host_terms_too(fake_cuda):
    fit = {"accelerator": "cuda", "ranks": 1, "needed_mib": 40_000.0, "available_mib": 30_000.0,
           "total_mib": 32_000.0, "cgroup_limit_mib": None, "budget_mib": None, "room_mib": 30_000.0, "fits": False}
    with pytest.raises(ConfigError) as err:
        planning.guard(_cfg("refuse"), Plan.made(gpu_peak_mib=900.0, host_fit=fit))  # the GPU has room, the host not
    assert "40,000 MiB of host memory (offloaded states" in err.value.problem and "GPU" not in err.value.problem


def test_parameter_blocks_follow_where_zero_keeps_the_parameters():
    from zerotune.plan.predict import param_blocks

    numels, on_gpu = [15 * MIB, 100, 7], {"where": {"params": "gpu"}, "params_bytes": (15 * MIB + 107) * 2}
    flat, how = param_blocks(numels, 2, "bf16", True, on_gpu)
    assert flat == [(15 * MIB + 107) * 2] and "flat" in how  # ZeRO-1/2: one buffer, one 2 MiB rounding
    assert allocator.reserved_bytes(flat) - flat[0] < 2 * MIB
    separate, _ = param_blocks(numels, 0, "bf16", True, on_gpu)  # stage 0 and plain DDP: a block each
    assert separate == [30 * MIB, 200, 14]
    assert allocator.reserved_bytes(separate) == 30 * MIB + 2 * MIB  # a large block, a small segment
    assert param_blocks(numels, 2, "bf16", False, on_gpu)[0] == separate
    assert param_blocks(numels, 3, "bf16", True, on_gpu)[0] == []


def test_frozen_parameters_are_blocks_of_their_own_beside_the_flat_buffer():
    from zerotune.plan.predict import param_blocks

    # an adapter's base: the 15 MiB and the 7 frozen, the two 100s trained (ZeRO-1/2 flatten those only)
    numels, trained, on_gpu = [15 * MIB, 100, 7, 100], [100, 100], {"where": {"params": "gpu"}}
    blocks, how = param_blocks(numels, 1, "bf16", True, on_gpu, trained)
    assert sorted(blocks) == sorted([200 * 2, 30 * MIB, 14]) and "frozen" in how
    # the flat 400 B and the frozen 14 B share a small segment; the 30 MiB block is one of its own
    assert allocator.reserved_bytes(blocks) == 30 * MIB + 2 * MIB
    assert param_blocks(numels, 0, "bf16", True, on_gpu, trained)[0] == [30 * MIB, 200, 14, 200]
    assert param_blocks(numels, 2, "bf16", True, on_gpu, numels)[0] == [(15 * MIB + 207) * 2]  # nothing frozen


# ------------------------------------------------------------------------------------------ commands
# `zerotune plan` through its main() in this process (tests/test_console_scripts.py runs it as a process).


def test_plan_command_json_has_the_per_rank_gpu_peak():
    # overrides before and after the flags, as users type them
    proc = call_main(plan_main, "train.batch_size=8", "--gpu", "rtx4090", "--json",
                     "deepspeed.reduce_bucket_size=1000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert "batch 8x1" in plan["workload"]
    assert {t["term"]: t["mib"] for t in plan["gpu_terms"]}["deepspeed:ipg_bucket"] == pytest.approx(1000 * 4 / MIB)
    # the step's peak: what it holds throughout plus its largest moment's terms (plan/predict.py)
    moments = {t.get("moment", "persistent") for t in plan["gpu_terms"]}
    at = {m: sum(t["mib"] for t in plan["gpu_terms"] if t.get("moment", "persistent") in ("persistent", m))
          for m in moments}
    assert plan["gpu_peak_mib"] == pytest.approx(at[plan["step_peak_moment"]]) == pytest.approx(max(at.values()))
    assert plan["run_peak_mib"] >= plan["gpu_peak_mib"] and plan["phases"]
    assert plan["gpu"]["name"] == "rtx4090" and plan["fits"] is True
    names = {t["term"] for t in plan["gpu_terms"]}
    assert {"cuda_context", "params", "grads", "activations", "allocator_rounding"} <= names


def test_plan_with_an_adapter_trains_and_averages_the_adapter_only():
    def plan(*args):
        proc = call_main(plan_main, "ema.enabled=true", "--json", *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        answer = json.loads(proc.stdout)
        return answer, {t["term"]: t["mib"] * MIB for t in answer["gpu_terms"] + answer["host_terms"]}

    (full, full_terms), (lora, lora_terms) = plan(), plan("adapter=lora")
    assert full["frozen_params"] == 0 and lora["frozen_params"] == full["trainable_params"]
    assert "adapter lora rank 16" in lora["workload"] and "adapter" not in full["workload"]
    # ZeRO-2 in fp32: every parameter (base + adapter) on the GPU; gradients and EMA of the adapter only
    elements = lora["trainable_params"] + lora["frozen_params"]
    assert lora_terms["params"] == pytest.approx(elements * 4) and full_terms["params"] < lora_terms["params"]
    assert lora_terms["grads"] == pytest.approx(lora["trainable_params"] * 4)
    assert lora_terms["ema"] == pytest.approx(lora["trainable_params"] * 4)
    assert full_terms["ema"] == pytest.approx(full["trainable_params"] * 4)
    assert lora_terms["model_load"] == pytest.approx(elements * 4)  # the fp32 build is the whole U-Net
    assert lora["trace"]["key"] != full["trace"]["key"] and "lora-r16" in lora["trace"]["key"]


@pytest.mark.parametrize(("args", "key"), [(["--gpu", "rtx5090"], "--gpu"), (["--gpu-mib", "-5"], "--gpu-mib"),
                                           (["plan.gpu=gtx1080"], "plan.gpu")])
def test_plan_command_bad_gpu_exits_2_naming_the_key(args, key):
    proc = call_main(plan_main, *args)
    assert proc.returncode == 2 and f"`{key}`" in proc.stderr


def test_plan_only_job_predicts_without_training(tmp_path):
    proc = run_cli("plan.only=true", "plan.gpu=l4", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "planned" and summary["plan"]["gpu"]["name"] == "l4"
    assert summary["plan"]["gpu_peak_mib"] > 0 and "steps" not in summary
    assert not (tmp_path / "run" / "logs").exists(), "no worker was started"


def test_plan_only_sweep_plans_every_job(tmp_path):
    proc = run_cli("-m", "plan.only=true", "zero_stage=1,3", "plan.gpu=rtx4090", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summaries = [read_summary(tmp_path / job) for job in ("0", "1")]
    assert [s["status"] for s in summaries] == ["planned", "planned"]
    # ZeRO-3 partitions the parameters too, but with one rank its share is the whole model.
    assert summaries[0]["plan"]["workload"] != summaries[1]["plan"]["workload"]


def test_a_plan_for_a_named_card_is_checked_as_a_config_for_that_card():
    """Lion without offload needs DeepSpeed's fused CUDA kernel: this CPU machine cannot run it, a card can."""
    from zerotune.plan.command_line import plan_one

    plan = plan_one(["optimizer=lion", "zero_stage=2", "offload=none"], gpus.lookup("rtx4090"))
    assert plan.gpu_peak_mib > 0 and plan.fits is True
    with pytest.raises(ConfigError) as err:
        plan_one(["optimizer=lion", "zero_stage=2", "offload=none"], None)
    assert err.value.key == "optimizer.type" and "FusedLion" in err.value.problem


# ------------------------------------------------------------------------------------------ the micro batch planned

EXPERIMENTS = {
    "tiny_bs4": "# @package _global_\ndefaults:\n  - override /model: tiny\ntrain:\n  batch_size: 4\n",
    # chooses data=digits, whose recipe gives the batch
    "on_digits": "# @package _global_\ndefaults:\n  - override /data: digits\n",
}


@pytest.fixture
def own_experiments(tmp_path, monkeypatch):
    folder = tmp_path / "zerotune" / "experiment"
    folder.mkdir(parents=True)
    for name, text in EXPERIMENTS.items():
        (folder / f"{name}.yaml").write_text(text)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    monkeypatch.chdir(tmp_path)  # ./zerotune/ is the user's config folder
    return folder


@pytest.mark.parametrize(("overrides", "value", "source", "said", "file"), [
    ([], 64, "default config", "the default config's data=digits", "data/digits.yaml"),
    (["data=synthetic"], 64, "default config", "the default config (", "conf/config.yaml"),
    (["data=digits"], 64, "option", "data=digits, typed on the command line", "data/digits.yaml"),
    (["train.batch_size=8"], 8, "command line", "the command line: train.batch_size=8", None),
    (["experiment=tiny_bs4"], 4, "experiment", "experiment=tiny_bs4 (zerotune/experiment/tiny_bs4.yaml)",
     "zerotune/experiment/tiny_bs4.yaml"),
    (["experiment=on_digits"], 64, "option", "data=digits, chosen by experiment=on_digits", "data/digits.yaml"),
    (["deepspeed.config_file=ds.json"], 2, "file", "ds.json: train_micro_batch_size_per_gpu", "ds.json"),
])
def test_the_plan_says_which_micro_batch_it_planned_and_where_it_came_from(own_experiments, overrides, value,
                                                                           source, said, file):
    from zerotune.plan.command_line import plan_one

    plan = plan_one([*overrides, "accelerate.config_file=null"], None)
    found = plan.micro_batch
    assert (found["value"], found["source"]) == (value, source)
    assert said in found["from"], found["from"]
    assert found["file"] is None if file is None else found["file"].endswith(file)
    assert f"batch {value}x1 per rank" in plan.workload  # the batch named is the batch planned


def test_the_plan_text_names_the_micro_batch_and_how_to_plan_another():
    from zerotune.plan import command_line

    default = {"value": 64, "source": "default config", "from": "the default config's data=digits (d.yaml)"}
    typed = {"value": 8, "source": "command line", "from": "the command line: train.batch_size=8"}
    ranked = {"micro_batch": default, "options": [], "recommended": {"option": None, "why": "no GPU named"}}
    assert command_line.ranking(ranked).splitlines()[0] == (
        "micro batch: 64 per rank, from the default config's data=digits (d.yaml); train.batch_size=N plans another")
    assert command_line.micro_batch_lines(typed) == ["micro batch: 8 per rank, from the command line: train.batch_size=8"]


def test_the_readmes_plan_example_plans_the_batch_it_names():
    """The README's and the docs' example (the wheel section, "Will it fit?"): SDXL at 1024², micro batch 8 in
    bf16 on a 4090 (the default job's batch is 64)."""
    from tests.helpers.cli import ROOT

    example = "zerotune plan model=sdxl resolution=1024 train.batch_size=8 precision=bf16 --gpu rtx4090"
    for page in ("README.md", "docs/getting-started.md", "docs/planner.md"):
        assert example in (ROOT / page).read_text(), page
    proc = call_main(plan_main, *example.split()[2:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == "micro batch: 8 per rank, from the command line: train.batch_size=8"
    assert "batch 8x1 per rank" in lines[0] and "bf16" in lines[0]
    peak = float(lines[2].split("GPU peak per rank: ")[1].split(" MiB")[0].replace(",", ""))
    assert 20_000 < peak < 200_000  # batch 8's (batch 64 in fp32 planned 895,169 MiB)
