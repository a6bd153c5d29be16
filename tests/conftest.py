"""Fixtures shared by every test (helpers live in tests/helpers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import xdist_groups

# Before any test module imports torch: under pytest-xdist each worker and the jobs it starts (launch.threads=auto
# takes OMP_NUM_THREADS) share the cores with the other workers. A thread count the user set is kept.
if (_threads := xdist_groups.threads_per_worker()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which names each item's group in its node id
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup`, tests that share a session or module fixture run on one worker, and the tests
    that share nothing are handed out longest first (tests/durations.json). Tests marked
    `cuda` need a CUDA GPU: skipped where torch sees none (torch is imported only if some are collected)."""
    if config.pluginmanager.hasplugin("xdist") and xdist_groups.grouping(config):
        xdist_groups.mark_groups(items, Path(__file__).parent)
        xdist_groups.longest_first(items, xdist_groups.read_durations(Path(__file__).parent))
    wanting = [item for item in items if item.get_closest_marker("cuda")]
    if not wanting:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in wanting:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_accelerate_config(tmp_path_factory, monkeypatch):
    """accelerate.config_file=auto reads accelerate's default location: point it (and HF_HOME, for the CLI
    subprocesses) at an empty folder, so a developer's own ~/.cache/huggingface config never leaks in."""
    from zerotune.config import accelerate_file as accelerate_config

    home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(accelerate_config, "default_location", lambda: home / "accelerate" / "default_config.yaml")
    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    return home


@pytest.fixture(autouse=True)
def packaged_configs_only(monkeypatch):
    """No user config folder unless a test makes one: a command's --config-dir choice (kept for the process,
    and passed on as $ZEROTUNE_CONFIG_DIR) ends with the test that made it."""
    from zerotune.config import search as config_search

    monkeypatch.setattr(config_search, "_chosen", None)
    monkeypatch.setenv(config_search.CONFIG_DIR_ENV, "")  # empty is unset; restored (removed) afterwards


# The default job (ZeRO-2, the tiny U-Net on the digits), short: 20 steps of 8 images, evaluated on 2 samples per
# class in 2 sampler steps, with its final checkpoint. ema.decay=0 makes the EMA a host copy of the live weights
# after every step (lerp with weight 1 is exact): the trained weights at the last step, taken outside DeepSpeed's
# checkpoint, to compare an export with.
DEFAULT_JOB_STEPS = 20
DEFAULT_JOB_ARGS = ("train.batch_size=8", f"train.max_steps={DEFAULT_JOB_STEPS}", "train.log_every=1",
                    "evaluate.per_class=2", "evaluate.steps=2", "ema.enabled=true", "ema.decay=0")


@pytest.fixture(scope="session")
def default_job_run(tmp_path_factory):
    """(run dir, summary) of DEFAULT_JOB_ARGS through the CLI: trained once, read (never written) by the tests of
    what such a run leaves: its final checkpoint and export, its measured phases."""
    from tests.helpers.cli import read_summary, run_cli

    run_dir = tmp_path_factory.mktemp("default_job") / "run"
    proc = run_cli(*DEFAULT_JOB_ARGS, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, read_summary(run_dir)


# README's `python train.py zero_stage=2 offload=cpu`, short: tests/test_train_cli.py's QUICK run of 4 steps of 8
# images, with a checkpoint every 2 steps.
OFFLOAD_RUN_ARGS = ("zero_stage=2", "offload=cpu", "train.max_steps=4", "train.batch_size=8",
                    "train.log_every=1", "evaluate.enabled=false", "scheduler=constant", "checkpoint.every_n_steps=2")


@pytest.fixture(scope="session")
def offload_run(tmp_path_factory):
    """(run dir, CompletedProcess) of OFFLOAD_RUN_ARGS through the CLI: trained once, read (never written; copy
    it to change it) by the README's offload test and the damaged-checkpoint tests (its two checkpoints)."""
    from tests.helpers.cli import run_cli

    run_dir = tmp_path_factory.mktemp("offload") / "run"
    proc = run_cli(*OFFLOAD_RUN_ARGS, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


LLAMAFACTORY_OFFLOAD = "llamafactory_z3_offload.json"  # in tests/data/ds_configs


@pytest.fixture(scope="session")
def llamafactory_offload_run(tmp_path_factory):
    """(run dir, CompletedProcess): LLaMA-Factory's ZeRO-3 offload file, whose keys DeepSpeed does not read are
    warned of, trained 2 steps through the CLI from the corpus folder, as its authors run it. Trained once, read
    by the tests of what a user's file trains (test_user_configs) and of what the workers read (test_resolved)."""
    from tests.helpers.cli import run_cli
    from tests.helpers.ds_corpus import CORPUS, QUICK, file_override

    run_dir = tmp_path_factory.mktemp("llamafactory") / "run"
    proc = run_cli(*file_override(LLAMAFACTORY_OFFLOAD), *QUICK, f"hydra.run.dir={run_dir}", cwd=CORPUS)
    return run_dir, proc


@pytest.fixture(scope="module")
def tiny_sdxl_components(tmp_path_factory):
    """Tiny random SDXL components (tests/helpers/tiny_components.py), saved once per test module (about a second;
    the same seeded weights each time): a model.components folder for every test that caches or trains on
    data=folder. Per module, not per session: tests/helpers/xdist_groups.py puts every user of one session
    fixture on one worker, which made this folder's eight modules one worker's queue."""
    from tests.helpers.tiny_components import save_tiny_pipeline

    return save_tiny_pipeline(tmp_path_factory.mktemp("sdxl_tiny"))


@pytest.fixture(scope="session")
def built_offload_ops():
    """The torch extensions cache this session's jobs use, with the ops an offload=cpu job loads built and current:
    by an earlier job, or here, once (a fresh clone's cache is empty: minutes, which its offload runs pay anyway).
    For tests that work on a copy of the built ops, which would otherwise have nothing to copy."""
    from tests.helpers.built_ops import OFFLOAD_CPU_OPS, build_offload_ops, is_current
    from zerotune.host.ops_env import extensions_root

    root = extensions_root()
    if not all(is_current(root / op) for op in OFFLOAD_CPU_OPS):
        build_offload_ops(root)
    missing = [op for op in OFFLOAD_CPU_OPS if not is_current(root / op)]
    assert not missing, f"built, but not current in {root}: {missing}"
    return root


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real two-node SLURM cluster on this machine (scripts/slurm_local.sh), stopped by its pids after the
    session. `make setup` installs the daemons; without them (or without root) the tests that need one fail."""
    from tests.helpers import slurm_cluster as local

    reason = local.missing()
    if reason:
        pytest.fail(f"no local SLURM cluster: {reason}")
    cluster = local.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    local.stop(cluster)
