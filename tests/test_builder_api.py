"""The builder page's server, called as the page calls it (FastAPI's TestClient): fields from the config
groups, the preview and its errors, will-it-fit, experiments, import, results, and every bad request it must
refuse. Each test runs in its own working directory, as an installed user's: experiments are saved in its
./zerotune/experiment/ (or --config-dir's), results read from its multirun/ and outputs/, and the package's
own configs are never written."""

from __future__ import annotations

import json
import shlex
import urllib.request
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.helpers.browser import start_builder, stop_builder
from tests.helpers.builder_workdir import PACKAGED_EXPERIMENTS, packaged_configs, run_in, with_multirun_readme
from tests.helpers.cli import cli_env, preflight, run_cli
from zerotune.builder import access, form, preview
from zerotune.builder import app as builder_app
from zerotune.builder import workspace as experiments
from zerotune.cli import builder as server
from zerotune.config import search
from zerotune.config.compose import compose
from zerotune.config.compose.overrides import parse_typed
from zerotune.host.platform import Platform
from zerotune.plan.predict import predict

TOKEN = "builder-api-test-token"
PACKAGED_EXPERIMENT = "sdxl_4090_128_bs8"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The page's calls as the page makes them: to 127.0.0.1, with the server's token (test_builder_security.py
    checks what happens without)."""
    with pytest.MonkeyPatch.context() as mp:
        run_in(mp, tmp_path_factory.mktemp("builder_start"))
        app = builder_app.create_app(token=TOKEN)
        with TestClient(app, base_url="http://127.0.0.1:8765", headers={"X-Zerotune-Token": TOKEN},
                        raise_server_exceptions=False) as c:
            yield c


@pytest.fixture(autouse=True)
def workdir(monkeypatch, tmp_path) -> Path:
    """Each test in a working directory of its own; whatever it saves, the package's configs stay as they were."""
    before = packaged_configs()
    yield run_in(monkeypatch, tmp_path)
    assert packaged_configs() == before


@pytest.fixture
def experiment_name(request):
    return f"builder_test_{request.node.name[:20].strip('_')}".replace("[", "_").replace("]", "")


def user_experiments(cwd: Path) -> Path:
    """Where the page saves when no folder was chosen: ./zerotune/experiment/."""
    return cwd / "zerotune" / "experiment"


def run_shown(command: str, *args: str, cwd: Path, env: dict | None = None):
    """A command line the page shows (`zerotune train ...`), run as the user would run it, in `cwd`."""
    words = shlex.split(command)
    assert words[:2] == ["zerotune", "train"], command
    return run_cli(*words[1:], *args, module="zerotune", cwd=cwd, env=env)


def _preview(client, choices=None, values=None, extra=None) -> dict:
    answer = client.post("/api/preview", json={"choices": choices or {}, "values": values or {}, "extra": extra or []})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_page_lists_every_group_option_and_knob_from_conf(client):
    html = client.get("/").text
    for group, options in search.current().group_options().items():
        if group in form.HIDDEN_GROUPS:
            assert f'name="{group}"' not in html
            continue
        assert f'name="{group}"' in html
        for option in options:
            assert f'value="{option}"' in html
    for key in ("train.batch_size", "train.gradient_checkpointing", "offload.path", "launch.num_processes"):
        assert f'name="{key}"' in html


def test_a_yaml_file_added_to_a_group_appears_without_code_changes(client, workdir):
    assert 'value="40"' not in client.get("/").text
    added = workdir / "zerotune" / "resolution" / "40.yaml"  # the user's folder: the package stays as it is
    added.parent.mkdir(parents=True)
    added.write_text("# 40x40 pixels, added by a test\nsize: 40\n")
    assert 'value="40"' in client.get("/").text
    answer = _preview(client, {"resolution": "40", "data": "synthetic"})
    assert "resolution=40" in answer["command"] and "size: 40" in answer["composed"], answer


def test_options_the_platform_cannot_run_are_disabled_with_the_reason():
    mac = Platform("mps", False, "DeepSpeed does not support macOS/MPS", bf16=False, fp16=True)
    fields = {f.key: f for f in form.fields(mac)}
    stages = {o.name: o.disabled for o in fields["zero_stage"].options}
    assert stages["0"] is None and all("macOS" in stages[s] for s in ("1", "2", "3"))
    offload = {o.name: o.disabled for o in fields["offload"].options}
    assert offload["none"] is None and "DeepSpeed" in offload["nvme"]
    precision = {o.name: o.disabled for o in fields["precision"].options}
    assert precision["bf16"] and precision["fp16"] is None and precision["fp32"] is None


def test_nvme_without_a_path_is_an_error_at_the_path_field_and_a_path_fixes_it(client):
    answer = _preview(client, {"zero_stage": "3", "offload": "nvme"})
    assert [e["field"] for e in answer["errors"]] == ["offload.path"]
    assert "offload.path=" in answer["errors"][0]["fix"] and "ds_config" not in answer
    fixed = _preview(client, {"zero_stage": "3", "offload": "nvme"}, {"offload.path": "/tmp/zt nvme"})
    assert fixed["errors"] == []
    assert fixed["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/tmp/zt nvme"
    assert fixed["command"] == "zerotune train zero_stage=3 offload=nvme \"offload.path='/tmp/zt nvme'\""


def test_the_preview_command_is_what_zerotune_train_composes(client, workdir):
    answer = _preview(client, {"zero_stage": "1", "optimizer": "lion", "data": "synthetic"},
                      {"train.batch_size": "4", "train.gradient_checkpointing": True, "train.seed": "0"})
    assert answer["overrides"] == ["zero_stage=1", "optimizer=lion", "data=synthetic", "train.batch_size=4",
                                   "train.gradient_checkpointing=true"]  # seed 0 is the default: left out
    assert answer["command"] == "zerotune train " + " ".join(answer["overrides"])
    shown = run_shown(answer["command"], "--cfg", "job", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == answer["composed"].strip()


@pytest.mark.parametrize(("values", "field"), [({"train.batch_size": "abc"}, "train.batch_size"),
                                               ({"train.max_steps": "0"}, "train.max_steps"),
                                               ({"optimizer.lr": "fast"}, "optimizer.lr")])
def test_a_bad_value_is_shown_at_its_field(client, values, field):
    answer = _preview(client, values=values)
    assert [e["field"] for e in answer["errors"]] == [field], answer["errors"]


def test_a_deepspeed_error_is_shown_at_the_group_that_sets_it(client):
    answer = _preview(client, {"precision": "fp16"})
    if answer["errors"]:  # this CPU cannot train in fp16
        assert answer["errors"][0]["field"] == "precision"
    assert preview.field_for("zero_optimization.stage") == "zero_stage"
    assert preview.field_for("train_micro_batch_size_per_gpu") == "train.batch_size"
    assert preview.field_for("something.unknown") is None


def test_an_unexpected_failure_is_shown_and_the_server_keeps_serving(client, monkeypatch):
    def broken(*_, **__):
        raise RuntimeError("validator exploded")

    monkeypatch.setattr(preview, "check", broken)
    answer = client.post("/api/preview", json={"choices": {}, "values": {}})
    assert answer.status_code == 500 and "validator exploded" in answer.json()["error"]["problem"]
    monkeypatch.undo()
    assert _preview(client)["errors"] == []


def test_requests_over_one_mib_are_refused(client):
    answer = client.post("/api/import", content=b'{"text": "' + b"x" * (1 << 20) + b'"}',
                         headers={"content-type": "application/json"})
    assert answer.status_code == 413 and "1 MiB" in answer.json()["error"]["problem"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(300):
            yield b"y" * 4096
        yield b'"}'

    assert client.post("/api/import", content=chunks(), headers={"content-type": "application/json"}).status_code == 413
    assert client.get("/api/experiments").status_code == 200


def test_the_fit_bar_adds_up_to_the_planners_peak(client):
    answer = client.post("/api/fit", json={"choices": {}, "values": {}, "gpu": "rtx4090"})
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    assert plan["fits"] is True and plan["gpu"]["name"] == "rtx4090"
    assert sum(s["mib"] for s in plan["bar"]) == pytest.approx(plan["gpu_peak_mib"], rel=1e-12)
    assert {s["segment"] for s in plan["bar"]} == set(form_segments())
    cfg = compose([])
    expected = predict(preflight(cfg), form_gpu("rtx4090")).gpu_peak_mib
    assert plan["gpu_peak_mib"] == pytest.approx(expected)


def form_segments():
    from zerotune.builder.preview import CATEGORIES
    return CATEGORIES


def form_gpu(name):
    from zerotune.plan import gpus
    return gpus.lookup(name)


@pytest.mark.parametrize(("card", "key"), [({"gpu": "rtx5090"}, "gpu"), ({"gpu_mib": "-5"}, "gpu_mib"),
                                           ({"gpu_mib": "lots"}, "gpu_mib")])
def test_a_bad_card_names_its_field(client, card, key):
    answer = client.post("/api/fit", json={"choices": {}, "values": {}, **card})
    assert answer.status_code == 400 and answer.json()["error"]["key"] == key, answer.text
    assert answer.json()["error"]["field"] is None or answer.json()["error"]["key"] == key


def test_cheapest_fills_the_form_with_the_lowest_stage_that_fits(client):
    state = {"choices": {"model": "sdxl_tiny", "data": "synthetic", "resolution": "64"}, "values": {}}
    answer = client.post("/api/cheapest", json={**state, "gpu_mib": "24000"}).json()
    assert answer["recommended"]["option"].startswith("zero_stage=0 offload=none"), answer["recommended"]
    assert answer["form"]["choices"]["zero_stage"] == "0" and answer["form"]["choices"]["model"] == "sdxl_tiny"
    tight = client.post("/api/cheapest", json={**state, "gpu_mib": "1"}).json()
    assert tight["form"] is None and "nothing fits" in tight["recommended"]["why"]


SAVED_STATE = {"choices": {"zero_stage": "3", "offload": "cpu", "data": "synthetic"},
               "values": {"train.batch_size": "4", "train.max_steps": "7"},
               "extra": ["deepspeed.reduce_bucket_size=1000000"]}


def test_save_then_load_an_experiment_and_zerotune_train_runs_it(client, experiment_name, workdir):
    state = SAVED_STATE
    folder = user_experiments(workdir)
    assert not (workdir / "zerotune").exists()  # the first save makes the user's folder
    assert f'id="experiments-folder">{folder}<' in client.get("/").text  # the page says where it saves
    saved = client.post("/api/experiment", json={**state, "name": experiment_name})
    assert saved.status_code == 200, saved.text
    assert saved.json()["path"] == str(folder / f"{experiment_name}.yaml")
    assert saved.json()["command"] == f"zerotune train experiment={experiment_name}"
    assert sorted(p.name for p in folder.iterdir()) == [f"{experiment_name}.yaml"]
    text = (folder / f"{experiment_name}.yaml").read_text()
    assert text.startswith("# @package _global_") and "override /zero_stage: '3'" in text
    assert "batch_size: 4" in text and "lr:" not in text  # only what differs from the defaults
    loaded = client.get("/api/experiment", params={"name": experiment_name}).json()
    assert loaded["choices"]["zero_stage"] == "3" and loaded["values"]["train.max_steps"] == 7
    assert loaded["extra"] == ["deepspeed.reduce_bucket_size=1000000"]
    again = client.post("/api/experiment", json={**state, "name": experiment_name})
    assert again.status_code == 409 and again.json()["exists"] is True
    assert client.post("/api/experiment", json={**state, "name": experiment_name, "overwrite": True}).status_code == 200
    assert experiment_name in client.get("/api/experiments").json()["names"]
    shown = run_shown(saved.json()["command"], "--cfg", "job", cwd=workdir)
    assert shown.returncode == 0, shown.stderr
    assert "stage: 3" in shown.stdout and "batch_size: 4" in shown.stdout and "reduce_bucket_size: 1000000" in shown.stdout


def test_started_where_no_folder_is_yet_the_first_save_makes_it_and_is_found_there(client, experiment_name,
                                                                                   workdir):
    search.choose_and_warn(None)  # as `zerotune builder` starts, with no --config-dir and no ./zerotune/ yet
    saved = client.post("/api/experiment", json={**SAVED_STATE, "name": experiment_name})
    assert saved.status_code == 200, saved.text  # its check composes experiment=<name> from the new folder
    assert saved.json()["path"] == str(user_experiments(workdir) / f"{experiment_name}.yaml")
    assert experiment_name in client.get("/api/experiments").json()["names"]
    assert client.get("/api/experiment", params={"name": experiment_name}).json()["choices"]["zero_stage"] == "3"
    assert f'id="user-folder">{workdir / "zerotune"}<' in client.get("/").text


@pytest.mark.parametrize("how", ["--config-dir", "env"])
def test_a_config_folder_that_is_not_one_stops_the_server_before_it_serves(workdir, monkeypatch, capsys, how):
    missing = str(workdir / "no_such_folder")
    if how == "env":
        monkeypatch.setenv(search.CONFIG_DIR_ENV, missing)
    assert server.main(["--port", "0", *(["--config-dir", missing] if how == "--config-dir" else [])]) == 2
    assert "no_such_folder is not a folder" in capsys.readouterr().err


def test_with_a_chosen_config_dir_experiments_are_saved_and_found_there(client, experiment_name, workdir,
                                                                        tmp_path_factory):
    mine = tmp_path_factory.mktemp("my_configs")
    search.choose(mine)  # what `zerotune builder --config-dir <mine>` does at start
    page = client.get("/").text
    assert f'id="experiments-folder">{mine / "experiment"}<' in page and f'id="user-folder">{mine}<' in page
    saved = client.post("/api/experiment", json={**SAVED_STATE, "name": experiment_name})
    assert saved.status_code == 200, saved.text
    assert saved.json()["path"] == str(mine / "experiment" / f"{experiment_name}.yaml")
    assert (mine / "experiment" / f"{experiment_name}.yaml").is_file() and not (workdir / "zerotune").exists()
    command = saved.json()["command"]
    assert command == f"zerotune train --config-dir {mine} experiment={experiment_name}"
    assert _preview(client)["command"] == f"zerotune train --config-dir {mine}"
    loaded = client.get("/api/experiment", params={"name": experiment_name}).json()
    assert loaded["choices"]["zero_stage"] == "3" and loaded["values"]["train.max_steps"] == 7
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # the command names the folder: it runs from anywhere
    shown = run_shown(command, "--cfg", "job", cwd=elsewhere, env={search.CONFIG_DIR_ENV: ""})
    assert shown.returncode == 0, shown.stderr
    assert "stage: 3" in shown.stdout and "reduce_bucket_size: 1000000" in shown.stdout


def test_the_server_started_with_config_dir_saves_there(tmp_path_factory, workdir):
    """`zerotune builder --config-dir DIR`, started in a working directory: the save lands in DIR/experiment/."""
    mine = tmp_path_factory.mktemp("server_configs")
    env = {**cli_env(), "HF_HOME": str(tmp_path_factory.mktemp("hf_home"))}
    server = start_builder(env, "--config-dir", str(mine), cwd=workdir)
    try:
        request = urllib.request.Request(
            f"{server.base}api/experiment", method="POST", headers={"X-Zerotune-Token": server.token,
                                                                     "content-type": "application/json"},
            data=json.dumps({"name": "from_the_server", "choices": {"zero_stage": "1"}}).encode())
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for 127.0.0.1
        with direct.open(request, timeout=300) as answer:
            saved = json.loads(answer.read())
    finally:
        stop_builder(server.proc)
    assert saved["path"] == str(mine / "experiment" / "from_the_server.yaml"), saved
    assert "override /zero_stage: '1'" in (mine / "experiment" / "from_the_server.yaml").read_text()
    assert not (workdir / "zerotune").exists()


def test_packaged_experiments_are_listed_and_loaded_but_not_saved_over(client, workdir):
    assert (PACKAGED_EXPERIMENTS / f"{PACKAGED_EXPERIMENT}.yaml").is_file()
    assert PACKAGED_EXPERIMENT in client.get("/api/experiments").json()["names"]
    assert f'<option value="{PACKAGED_EXPERIMENT}">' in client.get("/").text
    loaded = client.get("/api/experiment", params={"name": PACKAGED_EXPERIMENT})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["choices"]["model"] == "sdxl" and loaded.json()["choices"]["resolution"] == "128"
    for overwrite in (False, True):
        refused = client.post("/api/experiment", json={**loaded.json(), "name": PACKAGED_EXPERIMENT,
                                                      "overwrite": overwrite})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["key"] == "name" and "packaged experiment" in error["problem"], error
        assert f"my_{PACKAGED_EXPERIMENT}" in error["fix"]
    assert not (workdir / "zerotune").exists()  # nothing written, not even the folder
    form_state = {k: loaded.json()[k] for k in ("choices", "values", "extra")}  # its reference.* as extra
    assert any(line.startswith("+reference.name=") for line in form_state["extra"])
    previewed = client.post("/api/preview", json=form_state)
    assert previewed.status_code == 200 and previewed.json()["errors"] == [], previewed.text
    renamed = client.post("/api/experiment", json={**form_state, "name": f"my_{PACKAGED_EXPERIMENT}"})
    assert renamed.status_code == 200, renamed.text  # the name the fix suggests
    assert Path(renamed.json()["path"]).parent == user_experiments(workdir)
    assert compose([f"experiment=my_{PACKAGED_EXPERIMENT}"]).reference.name == PACKAGED_EXPERIMENT


def test_a_save_that_fails_unexpectedly_keeps_no_file_and_the_previous_one(client, experiment_name, workdir,
                                                                          monkeypatch):
    target = user_experiments(workdir) / f"{experiment_name}.yaml"
    assert client.post("/api/experiment", json={**SAVED_STATE, "name": experiment_name}).status_code == 200
    kept = target.read_text()

    def broken(*_, **__):
        raise RuntimeError("composer exploded")

    monkeypatch.setattr(experiments, "_check_round_trip", broken)
    failed = client.post("/api/experiment", json={"choices": {"zero_stage": "1"}, "name": experiment_name,
                                                   "overwrite": True})
    assert failed.status_code == 500 and "composer exploded" in failed.json()["error"]["problem"]
    assert target.read_text() == kept
    other = client.post("/api/experiment", json={"choices": {"zero_stage": "1"}, "name": f"{experiment_name}_2"})
    assert other.status_code == 500 and not target.with_name(f"{experiment_name}_2.yaml").exists()


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "x" * 65, "name with space", "a\\b", "/etc/x",
                                  "", None, 7, "ok\x00", "ok\n"])
def test_an_experiment_name_that_could_leave_its_folder_is_refused(client, name, workdir):
    before = sorted(p.name for p in workdir.rglob("*"))
    answer = client.post("/api/experiment", json={"name": name, "choices": {"zero_stage": "1"}})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["key"] == "name" and "path separators" in answer.json()["error"]["problem"]
    assert sorted(p.name for p in workdir.rglob("*")) == before
    assert not (workdir / "escape.yaml").exists() and not (workdir.parent / "escape.yaml").exists()
    assert not (PACKAGED_EXPERIMENTS.parent / "escape.yaml").exists()


def test_loading_an_unknown_experiment_lists_the_known_ones(client):
    answer = client.get("/api/experiment", params={"name": "no_such_one"})
    assert answer.status_code == 400 and "sdxl_4090_1024_bs8" in answer.json()["error"]["fix"]


DS_JSON = """{
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 200000000}
}"""


def test_a_pasted_deepspeed_json_becomes_overrides(client, workdir):
    answer = client.post("/api/import", json={"text": DS_JSON})
    assert answer.status_code == 200, answer.text
    imported = answer.json()
    assert imported["kind"] == "deepspeed"
    assert {"zero_stage=3", "offload=cpu", "precision=bf16", "train.batch_size=4", "train.grad_accum=2"} <= set(
        imported["overrides"]), imported["overrides"]
    assert imported["choices"]["zero_stage"] == "3" and imported["values"]["train.batch_size"] == 4
    assert Path(imported["file"]).parent == access.imports_dir() == workdir / "outputs" / "builder-imports"


def test_a_pasted_accelerate_yaml_becomes_overrides(client):
    text = ("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\n"
            "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n  gradient_accumulation_steps: 4\n"
            "num_processes: 1\n")
    answer = client.post("/api/import", json={"text": text})
    assert answer.status_code == 200, answer.text
    assert {"zero_stage=2", "offload=cpu", "precision=bf16"} <= set(answer.json()["overrides"])


@pytest.mark.parametrize(("text", "where"), [('{\n  "zero_optimization": {\n    "stage": 3,\n  }\n}', "line 4, column 3"),
                                             ("compute_environment: LOCAL\n  bad: [1,\n", "line 2"),
                                             ("[1, 2]", "neither"), ("", "nothing was pasted")])
def test_a_malformed_paste_names_the_line_and_column(client, text, where):
    answer = client.post("/api/import", json={"text": text})
    assert answer.status_code == 400 and where in answer.json()["error"]["problem"], answer.text


@pytest.mark.parametrize("folder", ["../conf", "/etc", "multirun/../../conf", "experiments", "multirun/\x00"])
def test_a_results_folder_outside_multirun_and_outputs_is_refused(client, folder):
    answer = client.get("/api/sweep", params={"folder": folder})
    assert answer.status_code == 400 and answer.json()["error"]["key"] == "folder", answer.text


def test_a_symlink_out_of_multirun_is_refused(client, workdir, tmp_path_factory):
    with_multirun_readme(workdir)
    (workdir / "pyproject.toml").write_text("[project]\n")
    link = workdir / "multirun" / "builder-test-link"
    link.symlink_to(tmp_path_factory.mktemp("outside"), target_is_directory=True)
    assert client.get("/api/sweep", params={"folder": "multirun/builder-test-link"}).status_code == 400
    assert client.get("/api/file", params={"path": "multirun/README.md"}).status_code == 200
    assert client.get("/api/file", params={"path": "pyproject.toml"}).status_code == 400
    assert client.get("/api/file", params={"path": "../pyproject.toml"}).status_code == 400


def test_results_are_listed_from_the_working_directorys_multirun_and_outputs(client, workdir):
    assert client.get("/api/sweeps").json()["sweeps"] == []  # none here, whatever the checkout holds
    (workdir / "multirun" / "2026-01-01" / "10-00-00" / "0").mkdir(parents=True)  # a sweep's job, just started
    single = workdir / "outputs" / "2026-01-02" / "11-00-00"  # a single run: its folder holds the summary
    single.mkdir(parents=True)
    (single / "summary.json").write_text("{}")
    assert client.get("/api/sweeps").json()["sweeps"] == [
        {"folder": "outputs/2026-01-02", "jobs": 1}, {"folder": "multirun/2026-01-01/10-00-00", "jobs": 1}]


def test_a_planned_sweep_opens_with_predicted_columns_and_plots(client, workdir):
    sweep = workdir / "multirun" / "builder-test-sweep"
    run = run_cli("train", "-m", "plan.only=true", "plan.gpu=rtx4090", "zero_stage=1,2", f"hydra.sweep.dir={sweep}",
                  module="zerotune", cwd=workdir)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [s["folder"] for s in client.get("/api/sweeps").json()["sweeps"]]
    assert "multirun/builder-test-sweep" in listed
    opened = client.get("/api/sweep", params={"folder": "multirun/builder-test-sweep", "budget_mib": 24000}).json()
    assert "pred. GPU MiB" in opened["headers"] and len(opened["rows"]) == 2
    predicted = [json.loads((sweep / j / "summary.json").read_text())["plan"]["gpu_peak_mib"] for j in ("0", "1")]
    column = opened["headers"].index("pred. GPU MiB")
    assert sorted(r[column] for r in opened["rows"]) == sorted(f"{p:.0f}" for p in predicted)
    assert opened["budget"] and opened["plots"]
    png = client.get("/api/file", params={"path": opened["plots"][0]["file"]})
    assert png.status_code == 200 and png.content[:4] == b"\x89PNG"


@pytest.mark.parametrize("value", ["/tmp/zt nvme", "it's", 'say "hi"', "$HOME/x", "a\\b", "back`tick`"])
def test_the_command_line_survives_the_shell(value):
    import subprocess

    word = preview.shell_word(form.override("offload.path", value))
    echoed = subprocess.run(["bash", "-c", f"printf '%s\\n' {word}"], capture_output=True, text=True, check=True)
    assert echoed.stdout == form.override("offload.path", value) + "\n"
    assert parse_typed(echoed.stdout.strip()).value() == value


def test_concurrent_requests_each_compose_alone(client, experiment_name):
    """The page sends previews, plans and saves at once; Hydra's compose state is one per process."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [lambda i=i: client.post("/api/preview", json={"choices": {"zero_stage": str(i % 4)}}) for i in range(8)]
    calls += [lambda: client.post("/api/fit", json={"gpu": "rtx4090"}),
              lambda: client.post("/api/experiment", json={"name": experiment_name, "choices": {"zero_stage": "1"}}),
              lambda: client.get("/api/experiment", params={"name": "sdxl_4090_1024_bs8"})]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        answers = list(pool.map(lambda call: call(), calls))
    assert [a.status_code for a in answers] == [200] * len(calls), [a.text[:200] for a in answers if a.status_code != 200]
    assert [a.json()["errors"] for a in answers[:8]] == [[]] * 8


def test_the_fit_answer_marks_the_runs_phases_when_the_plan_has_them(client, monkeypatch):
    """The bar gets one mark per phase (plan/phases.py) when the plan carries them."""
    from zerotune.builder import preview as fit_module
    from zerotune.plan.phases import run_phases

    def with_phases(overrides, gpu):
        cfg = compose(overrides)
        checked = preflight(cfg)
        plan = predict(checked, gpu)
        return plan.adding(phases=run_phases(checked.config, checked, gpu, plan))

    monkeypatch.setattr(fit_module, "plan_job", with_phases)
    plan = client.post("/api/fit", json={"choices": {}, "values": {}, "gpu": "rtx4090"}).json()
    marks = plan["phase_marks"]
    assert [m["phase"] for m in marks] == [p["phase"] for p in plan["phases"]] and "step" in [m["phase"] for m in marks]
    assert [m["run_peak"] for m in marks].count(True) == 1
    assert max(m["mib"] for m in marks) >= plan["gpu_peak_mib"]
