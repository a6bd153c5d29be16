"""The builder page in a real browser: Debian's Chromium, headless, driven by Playwright, against
`zerotune builder` as a user starts it, in a working directory of theirs (the test's temporary folder: its
./zerotune/experiment/ gets the saved experiments). Each main state is saved as a screenshot
(into $ZEROTUNE_SCREENSHOTS when set, else the test's temporary folder)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.helpers.browser import launch, start_builder, stop_builder
from tests.helpers.builder_workdir import packaged_configs
from tests.helpers.cli import call_main, cli_env, run_cli
from zerotune.cli.plan import main as plan_main

SDXL_TRACE_S = 180_000  # ms: a cold SDXL 1024^2 batch-8 trace is ~20 s on 2 cores; a loaded machine is slower
expect.set_options(timeout=20_000)  # ms: the server composes and validates; a busy 2-core machine is slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The server's working directory; the package's own configs are as they were once its tests are done."""
    before = packaged_configs()
    yield tmp_path_factory.mktemp("builder_cwd").resolve()  # as the server's os.getcwd() names it
    assert packaged_configs() == before


@pytest.fixture(scope="module")
def experiments(workdir) -> Path:
    return workdir / "zerotune" / "experiment"


@pytest.fixture(scope="module")
def server(tmp_path_factory, workdir):
    """The page's address with its token, as the server printed it."""
    env = {**cli_env(), "HF_HOME": str(tmp_path_factory.mktemp("hf_home"))}
    env.pop("ZEROTUNE_CONFIG_DIR", None)  # the default: ./zerotune/ in the working directory
    builder = start_builder(env, cwd=workdir)
    try:
        yield builder.url
    finally:
        stop_builder(builder.proc)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = launch(p)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(server)
    expect(page.locator("#command")).to_have_text("zerotune train")
    yield page
    context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("ZEROTUNE_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_nvme_without_a_path_shows_the_error_at_the_path_field_and_a_path_changes_the_json(page, shots):
    page.select_option('select[name="zero_stage"]', "3")
    page.select_option('select[name="offload"]', "nvme")
    error = page.locator('[data-error-for="offload.path"]')
    expect(error).to_be_visible()
    expect(error).to_contain_text("NVMe offload needs a folder")
    expect(error).to_contain_text("offload.path=")
    expect(page.locator("#ds-json")).to_contain_text("no DeepSpeed JSON until the errors are fixed")
    page.screenshot(path=shots / "builder-nvme-error.png", full_page=True)

    page.fill('input[name="offload.path"]', "/tmp/zerotune-nvme")
    expect(error).to_be_hidden()
    expect(page.locator("#ds-json")).to_contain_text('"nvme_path": "/tmp/zerotune-nvme"')
    expect(page.locator("#command")).to_have_text("zerotune train zero_stage=3 offload=nvme offload.path=/tmp/zerotune-nvme")
    page.screenshot(path=shots / "builder-nvme-fixed.png", full_page=True)


def test_rtx4090_sdxl_1024_batch_8_shows_the_planners_figure(page, shots):
    page.select_option('select[name="model"]', "sdxl")
    page.select_option('select[name="data"]', "synthetic")
    page.select_option('select[name="resolution"]', "1024")
    page.select_option('select[name="precision"]', "bf16")
    page.fill('input[name="train.batch_size"]', "8")
    expect(page.locator("#command")).to_contain_text("train.batch_size=8")
    expect(page.locator("body")).to_have_attribute("data-valid", "true")
    page.select_option("#gpu", "rtx4090")
    status = page.locator("#fit-status")
    expect(status).to_have_attribute("data-gpu-peak-mib", re.compile(r"^\d"), timeout=SDXL_TRACE_S)
    shown = float(status.get_attribute("data-gpu-peak-mib"))
    expect(status).to_contain_text("of 24,564 MiB (rtx4090)")
    expect(status).to_contain_text("does not fit")  # full SDXL at ZeRO-2 without offload: ~57 GiB
    command = page.locator("#command").text_content().split()[2:]
    planned = call_main(plan_main, *command, "--gpu", "rtx4090", "--json")  # `zerotune plan`, in this process
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert shown == pytest.approx(json.loads(planned.stdout)["gpu_peak_mib"])
    expect(page.locator("#bar > div")).to_have_count(6)  # five segments and the card's line
    page.screenshot(path=shots / "builder-fit.png", full_page=True)


def test_a_saved_experiment_runs_with_zerotune_train(page, shots, workdir, experiments):
    name = "builder_browser_saved"
    target = experiments / f"{name}.yaml"
    assert not target.exists()
    expect(page.locator("#experiments-folder")).to_have_text(str(experiments))  # where the page saves
    page.select_option('select[name="zero_stage"]', "1")
    page.select_option('select[name="optimizer"]', "lion")
    page.fill('input[name="train.max_steps"]', "5")
    expect(page.locator("#command")).to_have_text("zerotune train zero_stage=1 optimizer=lion train.max_steps=5")
    page.fill("#experiment-name", name)
    page.click("#save")
    page.wait_for_selector('#saved:not([hidden]), [data-error-for="name"]:not([hidden])')
    assert page.locator('[data-error-for="name"]').is_hidden(), page.locator('[data-error-for="name"]').text_content()
    expect(page.locator("#saved")).to_contain_text(f"Saved {target}")
    expect(page.locator("#saved")).to_contain_text(f"zerotune train experiment={name}")
    shown = run_cli("train", f"experiment={name}", "--cfg", "job", module="zerotune", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    assert "name: lion" in shown.stdout and "stage: 1" in shown.stdout and "max_steps: 5" in shown.stdout
    page.screenshot(path=shots / "builder-saved.png", full_page=True)

    answers, asked = [False, True], []  # "exists: overwrite?" -- no, then yes

    def confirm(dialog):
        asked.append(dialog.message)
        dialog.accept() if answers[len(asked) - 1] else dialog.dismiss()

    page.on("dialog", confirm)
    page.fill('input[name="train.max_steps"]', "6")
    page.click("#save")
    _wait_until(page, lambda: asked)
    expect(page.locator("#saved")).to_be_hidden()
    assert len(asked) == 1 and "exists" in asked[0] and "max_steps: 5" in target.read_text()
    page.click("#save")
    expect(page.locator("#saved")).to_be_visible()
    assert len(asked) == 2 and "max_steps: 6" in target.read_text()


def _save_is_refused_at_the_name_field(page, workdir, name: str, *said: str) -> None:
    """Saving under `name` shows the error beside the name field, saying each of `said`, and writes nothing."""
    before = sorted(p.name for p in workdir.rglob("*"))
    page.fill("#experiment-name", name)
    page.click("#save")
    error = page.locator('[data-error-for="name"]')
    expect(error).to_be_visible()
    for text in said:
        expect(error).to_contain_text(text)
    assert sorted(p.name for p in workdir.rglob("*")) == before


def test_saving_under_a_packaged_experiments_name_is_refused_next_to_the_name_field(page, workdir, experiments):
    _save_is_refused_at_the_name_field(page, workdir, "sdxl_4090_128_bs8", "packaged experiment", "my_sdxl_4090_128_bs8")
    assert not (experiments / "sdxl_4090_128_bs8.yaml").exists()


def _wait_until(page, condition, timeout_s: float = 30) -> None:
    for _ in range(int(timeout_s * 20)):
        if condition():
            return
        page.wait_for_timeout(50)  # lets Playwright deliver the page's events meanwhile
    raise AssertionError("the page never got there")


def test_a_traversal_name_is_refused_next_to_the_name_field(page, workdir):
    _save_is_refused_at_the_name_field(page, workdir, "../../outside", "path separators")
    assert not (workdir / "outside.yaml").exists() and not (workdir.parent / "outside.yaml").exists()


def test_a_save_that_would_write_a_callback_is_refused_next_to_the_name_field(page, workdir, experiments):
    page.fill("#extra", "+hydra.callbacks.x._target_=os.system")
    _save_is_refused_at_the_name_field(page, workdir, "builder_browser_callback", "_target_", "remove the override")
    assert not (experiments / "builder_browser_callback.yaml").exists()


def test_a_loaded_callback_is_shown_not_editable_and_the_file_is_not_saved_over(page, shots, workdir, experiments):
    name = "builder_browser_hand_written"
    path = experiments / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# @package _global_\nhydra:\n  run:\n    dir: outputs/kept\n  callbacks:\n    x:\n"
                    "      _target_: builtins.open\n      file: victim.txt\n      mode: w\n")
    written = path.read_text()
    page.reload()  # the experiment list is the page's as it was served
    page.select_option("#experiment-list", name)
    page.click("#load")
    expect(page.locator("#not-editable-list")).to_contain_text("hydra.callbacks.x._target_=builtins.open")
    expect(page.locator("#extra")).to_have_value("hydra.run.dir=outputs/kept")
    expect(page.locator("#command")).to_have_text("zerotune train hydra.run.dir=outputs/kept")
    _save_is_refused_at_the_name_field(page, workdir, name, "hydra.callbacks.x._target_", "another name")
    assert path.read_text() == written
    page.screenshot(path=shots / "builder-not-editable.png", full_page=True)


def test_an_imported_deepspeed_json_fills_the_form(page, shots):
    page.fill("#import-text", '{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},'
              ' "bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 2}')
    page.click("#import")
    expect(page.locator("#import-overrides")).to_contain_text("zero_stage=3")
    expect(page.locator('select[name="zero_stage"]')).to_have_value("3")
    expect(page.locator('select[name="precision"]')).to_have_value("bf16")
    expect(page.locator('input[name="train.batch_size"]')).to_have_value("2")
    expect(page.locator("#command")).to_contain_text("zero_stage=3")
    page.screenshot(path=shots / "builder-import.png", full_page=True)
    page.fill("#import-text", '{"zero_optimization": {"stage": 3,}}')
    page.click("#import")
    expect(page.locator('[data-error-for="import"]')).to_contain_text("line 1, column 35")
