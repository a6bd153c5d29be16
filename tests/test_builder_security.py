"""The builder page against a hostile web page: a domain rebound to 127.0.0.1 (refused by its Host), a
request from another origin, a request without the server's token, and overrides that would read the
environment into the composed config (`${oc.env:WANDB_API_KEY}`). Through FastAPI's TestClient, and in
Debian's Chromium against the real server; both in a working directory of the test's own, as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from omegaconf import OmegaConf
from playwright.sync_api import expect, sync_playwright

from tests.helpers.browser import launch, start_builder, stop_builder
from tests.helpers.builder_workdir import PACKAGED_EXPERIMENTS, run_in, snapshot, with_multirun_readme
from tests.helpers.cli import ROOT, cli_env
from zerotune.builder import app as builder_app
from zerotune.builder import form, preview
from zerotune.builder.access import allowed_hosts, cookie_name
from zerotune.config.compose import compose
from zerotune.config.compose.overrides import (
    PURE_RESOLVERS,
    check_pure_interpolations,
    parse_typed,
    resolvers_in,
)
from zerotune.config.errors import ConfigError

TOKEN = "builder-security-test-token"
PORT = 8765
SECRET = "wandb-fake-secret-7f3a9c"
FORM = {"choices": {"zero_stage": "1"}, "values": {}, "extra": []}
# Every route, with a body that would change something if it were answered.
ROUTES = [("GET", "/", None), ("GET", "/api/experiments", None),
          ("GET", "/api/experiment?name=sdxl_4090_1024_bs8", None), ("POST", "/api/preview", FORM),
          ("POST", "/api/fit", {**FORM, "gpu": "rtx4090"}), ("POST", "/api/cheapest", {**FORM, "gpu": "rtx4090"}),
          ("POST", "/api/experiment", {**FORM, "name": "builder_security_written"}),
          ("POST", "/api/import", {"text": '{"zero_optimization": {"stage": 2}}'}), ("GET", "/api/sweeps", None),
          ("GET", "/api/file?path=multirun/README.md", None), ("GET", "/static/builder.js", None)]


@pytest.fixture(scope="module", autouse=True)
def workdir(tmp_path_factory) -> Path:
    """The module's working directory (its multirun/README.md is a file the page may serve)."""
    with pytest.MonkeyPatch.context() as mp:
        yield run_in(mp, with_multirun_readme(tmp_path_factory.mktemp("builder_cwd")))


@pytest.fixture(scope="module")
def app(workdir):
    return builder_app.create_app(token=TOKEN)


def client_for(app, base_url: str = f"http://127.0.0.1:{PORT}", **headers) -> TestClient:
    return TestClient(app, base_url=base_url, headers=headers, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(app):
    """The page's own calls: to 127.0.0.1, with the token."""
    return client_for(app, **{"X-Zerotune-Token": TOKEN})


def written_files() -> list[tuple[str, int, bytes]]:
    """Every file the page could write (the user's experiment folder, the import folder: both in the working
    directory) and the packaged experiments, with its modification time and content."""
    return snapshot(Path.cwd(), PACKAGED_EXPERIMENTS)


def user_experiment(name: str) -> Path:
    return Path.cwd() / "zerotune" / "experiment" / f"{name}.yaml"


def call(client: TestClient, method: str, path: str, body=None, **headers):
    return client.request(method, path, json=body, headers=headers)


def field_error(answer) -> dict:
    """The error a field shows: a 400's, or the preview's (which answers 200 with its errors listed)."""
    assert answer.status_code in (200, 400), answer.text
    data = answer.json()
    if answer.status_code == 400:
        return data["error"]
    assert len(data["errors"]) == 1, data
    return data["errors"][0]


# --- Host: a rebound domain name is not this machine ----------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_a_foreign_host_is_refused_on_every_route_and_nothing_is_written(app, method, path, body):
    evil = client_for(app, f"http://evil.example:{PORT}", **{"X-Zerotune-Token": TOKEN})
    before = written_files()
    answer = call(evil, method, path, body)
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["key"] == "host" and "evil.example" in error["problem"] and "--allow-host" in error["fix"]
    assert written_files() == before
    assert not user_experiment("builder_security_written").exists()
    assert not (PACKAGED_EXPERIMENTS / "builder_security_written.yaml").exists()


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example", "localhost.evil.example",
                                  "evil.example@127.0.0.1", "127.0.0.1 evil.example", "", "[::2]:8765"])
def test_a_host_header_that_is_not_this_machine_is_refused(client, host):
    answer = client.get("/api/experiments", headers={"host": host})
    assert answer.status_code == 403 and answer.json()["error"]["key"] == "host", answer.text


@pytest.mark.parametrize("base_url", [f"http://127.0.0.1:{PORT}", "http://127.0.0.1", f"http://localhost:{PORT}",
                                      "http://LOCALHOST", f"http://[::1]:{PORT}"])
def test_the_loopback_names_are_answered_at_any_port(app, base_url):
    answer = client_for(app, base_url, **{"X-Zerotune-Token": TOKEN}).get("/api/experiments")
    assert answer.status_code == 200, answer.text


def test_hosts_allowed_by_the_address_bound():
    loopback = allowed_hosts("127.0.0.1")
    assert [loopback.allows(n) for n in ("localhost", "127.0.0.1", "::1", "192.168.1.7", "evil.example")] == \
        [True, True, True, False, False]
    everywhere = allowed_hosts("0.0.0.0", ["gpu-box.lab.example"])
    import socket

    for name in ("192.168.1.7", "10.0.0.2", "fe80::1", socket.gethostname().lower(), "gpu-box.lab.example",
                 "localhost"):
        assert everywhere.allows(name), name
    assert not everywhere.allows("evil.example")
    one = allowed_hosts("10.1.2.3")
    assert one.allows("10.1.2.3") and not one.allows("10.1.2.4")


# --- Origin: only the page itself changes anything ------------------------------------------------------

@pytest.mark.parametrize("headers", [{"origin": "http://evil.example"}, {"origin": f"http://evil.example:{PORT}"},
                                     {"origin": "http://127.0.0.1:9999"}, {"origin": f"http://localhost:{PORT}"},
                                     {"origin": "null"}, {"sec-fetch-site": "cross-site"},
                                     {"sec-fetch-site": "same-site"}])
def test_a_state_changing_request_from_another_origin_is_refused(client, headers):
    before = written_files()
    answer = call(client, "POST", "/api/experiment", {**FORM, "name": "builder_security_written"}, **headers)
    assert answer.status_code == 403 and answer.json()["error"]["key"] == "origin", answer.text
    assert written_files() == before
    assert call(client, "POST", "/api/preview", FORM, **headers).status_code == 403


def test_the_pages_own_origin_may_post(client):
    answer = call(client, "POST", "/api/preview", FORM, origin=f"http://127.0.0.1:{PORT}",
                  **{"sec-fetch-site": "same-origin"})
    assert answer.status_code == 200 and answer.json()["errors"] == [], answer.text


# --- The token ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body"), [r for r in ROUTES if not r[1].startswith("/static/")],
                         ids=[f"{m} {p}" for m, p, _ in ROUTES if not p.startswith("/static/")])
def test_without_the_token_every_route_but_static_files_is_refused(app, method, path, body):
    before = written_files()
    anonymous = client_for(app)
    missing = call(anonymous, method, path, body)
    assert missing.status_code == 401 and missing.json()["error"]["key"] == "token", missing.text
    wrong = call(anonymous, method, path, body, **{"X-Zerotune-Token": TOKEN + "x"})
    assert wrong.status_code == 403 and wrong.json()["error"]["key"] == "token", wrong.text
    assert TOKEN not in missing.text + wrong.text
    assert written_files() == before


def test_the_static_files_need_no_token(app):
    assert client_for(app).get("/static/builder.js").status_code == 200


@pytest.mark.parametrize("headers", [{"X-Zerotune-Token": TOKEN}, {"Authorization": f"token {TOKEN}"},
                                     {"Authorization": f"Bearer {TOKEN}"}, {"Cookie": f"{cookie_name(PORT)}={TOKEN}"}])
def test_the_token_is_accepted_in_a_header_or_the_cookie(app, headers):
    assert client_for(app, **headers).post("/api/preview", json=FORM).status_code == 200
    assert client_for(app).post(f"/api/preview?token={TOKEN}", json=FORM).status_code == 200


def test_another_ports_cookie_is_not_this_servers(app):
    answer = client_for(app, Cookie=f"{cookie_name(PORT + 1)}={TOKEN}").get("/api/experiments")
    assert answer.status_code == 401


def test_the_page_opened_with_the_token_sets_the_cookie_its_calls_then_carry(app):
    browser = client_for(app)
    assert browser.get("/").status_code == 401
    page = browser.get("/", params={"token": TOKEN})
    assert page.status_code == 200 and f'<meta name="zerotune-token" content="{TOKEN}">' in page.text
    cookie = page.headers["set-cookie"]
    assert cookie.startswith(f"{cookie_name(PORT)}={TOKEN};")
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and "Path=/" in cookie
    assert browser.post("/api/preview", json=FORM).status_code == 200  # the cookie alone, as the plots' <img>
    assert browser.get("/api/file", params={"path": "multirun/README.md"}).status_code == 200


def test_without_a_token_the_app_needs_none_but_still_checks_host_and_origin():
    open_app = builder_app.create_app(token=None)
    assert client_for(open_app).post("/api/preview", json=FORM).status_code == 200
    assert 'name="zerotune-token"' not in client_for(open_app).get("/").text
    assert client_for(open_app, f"http://evil.example:{PORT}").get("/").status_code == 403
    assert client_for(open_app, origin="http://evil.example").post("/api/preview", json=FORM).status_code == 403


# --- Overrides that would read the environment ----------------------------------------------------------

ENV_READS = [({"values": {"data.path": "${oc.env:WANDB_API_KEY}"}}, "data.path"),
             ({"values": {"train.seed": "${oc.env:HOME}"}}, "train.seed"),
             ({"extra": ["data.path=${oc.env:WANDB_API_KEY}"]}, "data.path"),
             ({"extra": ["data.path='${oc.select:${oc.env:WANDB_API_KEY}}'"]}, "data.path"),
             ({"extra": ["data.path='${oc.decode:\"\\${oc.env:WANDB_API_KEY}\"}'"]}, "data.path"),
             ({"extra": ["+model.unet={secret: '${oc.env:WANDB_API_KEY}'}"]}, "model.unet"),
             ({"choices": {"data": "${oc.env:WANDB_API_KEY}"}}, "data")]


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HOME", "/home/builder-security-home")


@pytest.mark.parametrize("route", ["/api/preview", "/api/fit", "/api/cheapest", "/api/experiment"])
@pytest.mark.parametrize(("state", "field"), ENV_READS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(ENV_READS)])
def test_an_override_that_reads_the_environment_is_refused_at_its_field(client, secret_env, route, state, field):
    before = written_files()
    body = {**FORM, **state, "gpu": "rtx4090", "name": "builder_security_env"}
    answer = client.post(route, json=body)
    error = field_error(answer)
    assert error["key"] == field and error["field"] == preview.field_for(field), error
    assert "type the value itself" in error["fix"] and "resolver" in error["problem"]
    for value in (SECRET, "/home/builder-security-home"):
        assert value not in answer.text
    assert route != "/api/preview" or answer.status_code == 200
    assert written_files() == before


def test_the_fix_for_a_refused_interpolation_works_when_applied(client, secret_env):
    error = field_error(client.post("/api/preview", json={"values": {"train.seed": "${oc.env:HOME}"}}))
    typed = re.search(r"type the value itself: (\S+)", error["fix"])[1]
    assert typed == "train.seed=0"
    fixed = client.post("/api/preview", json={"extra": [typed]}).json()
    assert fixed["errors"] == [] and fixed["values"]["train.seed"] == 0


def test_a_pasted_file_that_reads_the_environment_is_refused(client, secret_env):
    before = written_files()
    text = json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "${oc.env:WANDB_API_KEY}"}}})
    answer = client.post("/api/import", json={"text": text})
    assert answer.status_code == 400 and answer.json()["error"]["key"] == "import", answer.text
    assert SECRET not in answer.text and written_files() == before


def test_a_pasted_file_that_is_no_deepspeed_config_is_refused_and_not_kept(client):
    text = (ROOT / "tests" / "data" / "ds_configs" / "gcp_service_account.json").read_text()
    private_key = json.loads(text)["private_key"]
    before = written_files()
    answer = client.post("/api/import", json={"text": text})
    assert answer.status_code == 400 and "not a DeepSpeed config" in answer.json()["error"]["problem"], answer.text
    assert private_key not in answer.text and "private_key" not in answer.text
    assert written_files() == before


def test_config_keys_and_pure_resolvers_are_still_allowed(client):
    answer = client.post("/api/preview", json={"values": {"data.path": "/data/${model.name}"},
                                                "extra": ["train.seed=${train.grad_accum}",
                                                          "offload.path='${oc.select:data.path,/tmp}'"]}).json()
    assert answer["errors"] == [], answer["errors"]
    composed = OmegaConf.to_container(OmegaConf.create(answer["composed"]), resolve=False)  # as typed
    assert composed["data"]["path"] == "/data/${model.name}" and composed["train"]["seed"] == "${train.grad_accum}"
    assert answer["values"]["data.path"] == f"/data/{answer['choices']['model']}"
    assert answer["values"]["train.seed"] == answer["values"]["train.grad_accum"]


def test_an_escaped_interpolation_is_text(client, secret_env):
    answer = client.post("/api/preview", json={"values": {"data.path": "/data/\\${oc.env:WANDB_API_KEY}"}}).json()
    assert answer["errors"] == [] and answer["values"]["data.path"] == "/data/${oc.env:WANDB_API_KEY}", answer
    assert SECRET not in json.dumps(answer)


@pytest.mark.parametrize(("extra", "key"), [("train.seed=${no.such.key}", "train.seed"),
                                            ("train.seed=${model.name}", "train.seed"),
                                            ("data.path=${no.such.key}", "data.path")])
@pytest.mark.parametrize("route", ["/api/preview", "/api/fit", "/api/experiment"])
def test_an_interpolation_that_does_not_resolve_is_a_field_error(client, extra, key, route):
    before = written_files()
    answer = client.post(route, json={"extra": [extra], "gpu": "rtx4090", "name": "builder_security_unresolved"})
    error = field_error(answer)
    assert error["key"] == key and error["field"] == key, error
    assert written_files() == before


# --- Overrides that are not configuration: what Hydra would run, Hydra's settings, unknown keys ---------

CALLBACK = "+hydra.callbacks.x._target_=os.system"
# (the request's state, the key its error names, what the problem says)
NOT_CONFIGURATION = [
    ({"extra": [CALLBACK]}, "hydra.callbacks.x._target_", "`_target_`"),
    ({"extra": ["++hydra.callbacks.x._target_=builtins.open", "++hydra.callbacks.x.file=victim.txt"]},
     "hydra.callbacks.x._target_", "`_target_`"),
    ({"extra": ["~model.unet._target_"]}, "model.unet._target_", "`_target_`"),
    ({"extra": ["+model.unet={block: {_target_: builtins.open, file: victim.txt, mode: w}}"]}, "model.unet",
     "`_target_`"),
    ({"values": {"train.seed": {"_target_": "os.system"}}}, "train.seed", "`_target_`"),
    ({"extra": ["hydra.run.dir=/etc"]}, "hydra.run.dir", "not a folder under multirun or outputs"),
    ({"extra": ["hydra.job_logging.root.level=DEBUG"]}, "hydra.job_logging.root.level", "Hydra's own settings"),
    ({"extra": ["hydra/job_logging=disabled"]}, "hydra/job_logging", "Hydra's own settings"),
    ({"extra": ["foo.bar=1"]}, "foo.bar", "zerotune has no key `foo`"),
]


@pytest.mark.parametrize("route", ["/api/preview", "/api/fit", "/api/cheapest", "/api/experiment"])
@pytest.mark.parametrize(("state", "key", "said"), NOT_CONFIGURATION,
                         ids=[f"{i}-{k}" for i, (_, k, _) in enumerate(NOT_CONFIGURATION)])
def test_an_override_that_is_not_configuration_is_refused_at_its_key(client, route, state, key, said):
    before = written_files()
    answer = client.post(route, json={**FORM, **state, "gpu": "rtx4090", "name": "builder_security_refused"})
    error = field_error(answer)  # the preview answers 200 with its errors, as for every refused value
    assert route == "/api/preview" or answer.status_code == 400, answer.text
    assert error["key"] == key and error["field"] == preview.field_for(key), error
    assert said in error["problem"] and "remove the override" in error["fix"], error
    assert written_files() == before and not user_experiment("builder_security_refused").exists()


def test_the_fixes_of_refused_overrides_work_when_applied(client):
    name = "builder_security_fixed"
    folder = field_error(client.post("/api/experiment", json={**FORM, "extra": ["hydra.run.dir=/etc"], "name": name}))
    suggested = folder["fix"].split(" ")[0]
    typo = field_error(client.post("/api/preview", json={"extra": ["train.batchsize=4"]}))
    corrected = re.search(r"set a key zerotune has: (\S+)", typo["fix"])[1]
    callback = field_error(client.post("/api/experiment", json={**FORM, "extra": [suggested, CALLBACK], "name": name}))
    removed = re.search(r"remove the override `([^`]+)`", callback["fix"])[1]
    assert (suggested, corrected, removed) == ("hydra.run.dir=outputs/my_run", "train.batch_size=4", CALLBACK)
    saved = client.post("/api/experiment", json={**FORM, "extra": [suggested, corrected], "name": name})
    assert saved.status_code == 200, saved.text
    text = user_experiment(name).read_text()
    assert "_target_" not in text and "dir: outputs/my_run" in text and "batch_size: 4" in text


def test_a_refused_save_leaves_the_experiment_it_would_overwrite_as_it_was(client):
    name = "builder_security_kept"
    assert client.post("/api/experiment", json={**FORM, "name": name}).status_code == 200
    before = written_files()
    refused = client.post("/api/experiment", json={**FORM, "extra": [CALLBACK], "name": name, "overwrite": True})
    assert refused.status_code == 400 and refused.json()["error"]["key"] == "hydra.callbacks.x._target_", refused.text
    assert written_files() == before


def test_the_run_and_sweep_folders_are_saved_and_loaded_back(client):
    name = "builder_security_folders"
    extra = ["hydra.run.dir=outputs/${now:%Y-%m-%d}/mine", "hydra.sweep.dir=multirun/mine",
             "hydra.sweep.subdir=job_${now:%H%M%S%f}"]
    saved = client.post("/api/experiment", json={**FORM, "extra": extra, "name": name})
    assert saved.status_code == 200, saved.text
    text = user_experiment(name).read_text()
    assert "dir: outputs/${now:%Y-%m-%d}/mine" in text and "subdir: job_${now:%H%M%S%f}" in text
    loaded = client.get("/api/experiment", params={"name": name}).json()
    assert loaded["not_editable"] == []
    assert [(o.key_or_group, o.value()) for o in map(parse_typed, loaded["extra"])] == \
        [(o.key_or_group, o.value()) for o in map(parse_typed, extra)]


@pytest.mark.parametrize("line", ["hydra.run.dir=outputs/../../etc", "hydra.run.dir=outputs/escape/run",
                                  "hydra.run.dir='outputs/${now:../../../etc}'", "hydra.run.dir=${data.path}",
                                  "hydra.run.dir='${oc.select:data.path,outputs/x}'", "hydra.sweep.dir=/tmp/sweep",
                                  "hydra.sweep.subdir=../../x", "~hydra.run.dir", "hydra.run={dir: outputs/x}",
                                  "hydra={run: {dir: outputs/x}}", "data@hydra.callbacks.x=folder"])
def test_a_folder_that_could_be_outside_outputs_and_multirun_is_refused(client, workdir, line):
    """Resolved as paths.py resolves the page's reads (a symlink out of outputs/ too); of interpolations only
    the time, as Hydra's own folders use it: another key's value could name any folder."""
    escape = workdir / "outputs" / "escape"
    if not escape.is_symlink():
        escape.parent.mkdir(exist_ok=True)
        escape.symlink_to("/etc")
    error = field_error(client.post("/api/preview", json={"extra": [line]}))
    assert error["key"] == parse_typed(line).key_or_group and "remove the override" in error["fix"], error


@pytest.mark.parametrize("line", ["zero_stage=3", "+reference.name=x", "model.unet.block_out_channels=[32,64]",
                                  "data.repeats={cats: 2}", "experiment=sdxl_4090_128_bs8", "~train.seed",
                                  "hydra.run.dir=outputs/x", "hydra.sweep.subdir=a/b"])
def test_configuration_and_the_folders_are_allowed(line):
    assert form.refusal(line) is None


HAND_WRITTEN = """# @package _global_
defaults:
  - override /zero_stage: "1"
  - override /hydra/job_logging: disabled
train:
  batch_size: 4
hydra:
  run:
    dir: outputs/kept
  callbacks:
    x:
      _target_: builtins.open
      file: victim.txt
      mode: w
"""


def test_an_experiment_holding_a_callback_loads_it_not_editable_and_is_never_saved_over(client):
    name = "builder_security_hand_written"
    path = user_experiment(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HAND_WRITTEN)
    loaded = client.get("/api/experiment", params={"name": name}).json()
    held = {entry["key"]: entry["override"] for entry in loaded["not_editable"]}
    assert held == {"hydra/job_logging": "hydra/job_logging=disabled",
                    "hydra.callbacks.x._target_": "hydra.callbacks.x._target_=builtins.open",
                    "hydra.callbacks.x.file": "hydra.callbacks.x.file=victim.txt",
                    "hydra.callbacks.x.mode": "hydra.callbacks.x.mode=w"}, loaded["not_editable"]
    assert loaded["extra"] == ["hydra.run.dir=outputs/kept"] and loaded["values"]["train.batch_size"] == 4
    form_state = {k: loaded[k] for k in ("choices", "values", "extra")}
    before = written_files()
    for overwrite in (False, True):  # refused before the page would ask to overwrite
        back = client.post("/api/experiment", json={**form_state, "name": name, "overwrite": overwrite})
        assert back.status_code == 400, back.text
        error = back.json()["error"]
        assert error["key"] == "name" and "hydra.callbacks.x._target_" in error["problem"], error
        assert "another name" in error["fix"] and str(path) in error["fix"]
    assert written_files() == before
    copy = client.post("/api/experiment", json={**form_state, "name": f"{name}_copy"})
    assert copy.status_code == 200, copy.text
    text = Path(copy.json()["path"]).read_text()
    assert "callbacks" not in text and "job_logging" not in text and "dir: outputs/kept" in text


def test_a_packaged_sweep_shows_its_sweeper_params_not_editable(client):
    loaded = client.get("/api/experiment", params={"name": "stage_resolution_batch"}).json()
    assert [e["key"] for e in loaded["not_editable"]] == [
        f"hydra.sweeper.params.{k}" for k in ("zero_stage", "offload", "resolution", "train.batch_size")]
    assert not any(line.startswith("hydra") for line in loaded["extra"])


# --- interpolation.py: what it finds in an override ------------------------------------------------------

@pytest.mark.parametrize(("text", "names"), [
    ("${oc.env:HOME}", ["oc.env"]),
    ("${oc.select:${oc.env:X},d}", ["oc.select", "oc.env"]),
    ("${oc.select:a,'${oc.env:X}'}", ["oc.select", "oc.env"]),
    ("a${now:%Y}b${oc.env:Y}c", ["now", "oc.env"]),
    ("${a.b}", []), ("${${a.b}}", []), ("${.sibling}", []),
    ("\\${oc.env:HOME}", []), ("/plain/path", []),
    ("${${name}:x}", ["${name}"]),   # a resolver named by an interpolation: never an allowed name
])
def test_resolvers_in_reads_omegaconfs_grammar(text, names):
    assert resolvers_in(text) == names


@pytest.mark.parametrize("line", [
    "data.path=${oc.env:HOME}", "data.path='${oc.env:HOME}'", 'data.path="pre-${oc.env:HOME}"',
    "data.path='${oc.select:${oc.env:HOME}}'", "model.lora_targets=[a,${oc.env:X}]",
    "model.unet={k: ${oc.env:X}}", "model.unet={k: [1, {j: '${oc.env:X}'}]}", "data.path=a,${oc.env:X}",
    "data.path=choice(a,'${oc.env:X}')", "data.path=glob(*${oc.env:X}*)", "data.path=str(${oc.env:X})",
    "~data.path=${oc.env:X}", "+data.extra=${oc.env:X}", "data.path='${hydra:runtime.cwd}'",
    "data.path='${oc.decode:1}'", "data.path='${oc.create:{a: 1}}'", "data.path='${unclosed'",
])
def test_a_resolver_outside_the_pure_ones_is_refused_at_the_overrides_key(line):
    with pytest.raises(ConfigError) as refused:
        check_pure_interpolations(["zero_stage=1", line])
    assert refused.value.key == re.match(r"[~+]*([\w.]+)=", line)[1]


@pytest.mark.parametrize("line", [
    "data.path=${model.name}", "data.path=/d/${model.name}", "data.path='\\${oc.env:HOME}'", "data.path=a,${x.y}",
    "data.path='${oc.select:model.name,d}'", "data.path='${now:%Y}'", "model.lora_targets='${oc.dict.keys:model}'",
    "~data.path", "data.path=plain", "model.unet={k: [1, 2]}", "train.seed=range(1,3)",
])
def test_config_keys_and_pure_resolvers_pass(line):
    check_pure_interpolations([line])


def test_oc_decode_and_oc_create_are_refused_because_they_read_what_they_parse(monkeypatch):
    """Each parses its string argument as config: an escaped `\\${oc.env:...}` in it is read after all."""
    monkeypatch.setenv("ZEROTUNE_TEST_SECRET", SECRET)
    decoded = OmegaConf.create({"a": "${oc.decode:'\\${oc.env:ZEROTUNE_TEST_SECRET}'}"})
    created = OmegaConf.create({"a": "${oc.create:'x: \\${oc.env:ZEROTUNE_TEST_SECRET}'}"})
    assert decoded.a == SECRET and created.a.x == SECRET
    assert not {"oc.decode", "oc.create", "oc.env"} & PURE_RESOLVERS


def test_a_refused_overrides_fix_composes():
    with pytest.raises(ConfigError) as refused:
        check_pure_interpolations(["train.seed=${oc.env:HOME}"])
    typed = re.search(r"type the value itself: (\S+)", refused.value.fix)[1]
    check_pure_interpolations([typed])
    assert compose([typed]).train.seed == 0


# --- In Chromium, against the real server ----------------------------------------------------------------

def test_a_rebound_domain_is_refused_in_chromium_and_the_printed_address_works(tmp_path, workdir):
    """evil.example resolves to 127.0.0.1 (Chromium's host resolver rules, as DNS rebinding would make it):
    its pages, and the calls they make as their own origin, are refused; the printed address works."""
    before = written_files()
    env = {**cli_env(), "HF_HOME": str(tmp_path / "hf_home"), "WANDB_API_KEY": SECRET}
    server = start_builder(env, cwd=workdir)
    try:
        with sync_playwright() as p:
            chromium = launch(p, ["--host-resolver-rules=MAP evil.example 127.0.0.1"])
            try:
                rebound = chromium.new_page()
                answer = rebound.goto(f"http://evil.example:{server.port}/?token={server.token}")
                assert answer.status == 403 and "evil.example" in rebound.content()
                calls = rebound.evaluate(ATTACK, server.token)
                assert [c["status"] for c in calls] == [403, 403, 403], calls
                assert all(json.loads(c["body"])["error"]["key"] == "host" for c in calls)
                assert SECRET not in json.dumps(calls) and written_files() == before

                anonymous = chromium.new_page()
                assert anonymous.goto(server.base).status == 401

                page = chromium.new_page()
                assert page.goto(server.url).status == 200
                expect(page.locator("#command")).to_have_text("zerotune train", timeout=60_000)
                assert page.evaluate("location.search") == ""  # the address bar no longer shows the token
                page.fill('input[name="data.path"]', "${oc.env:WANDB_API_KEY}")
                error = page.locator('[data-error-for="data.path"]')
                expect(error).to_contain_text("oc.env", timeout=60_000)
                expect(error).to_contain_text("type the value itself")
                assert SECRET not in page.content()
            finally:
                chromium.close()
    finally:
        stop_builder(server.proc)
    assert written_files() == before


# What a rebound page would do as its own origin: read the experiments, preview an environment read, save.
ATTACK = """async (token) => {
  const form = {choices: {}, values: {"data.path": "${oc.env:WANDB_API_KEY}"}, extra: []};
  const calls = [["GET", "/api/experiments"], ["POST", "/api/preview", form],
                 ["POST", "/api/experiment", {...form, name: "rebound"}]];
  const answers = [];
  for (const [method, url, body] of calls) {
    const init = {method, headers: {"content-type": "application/json", "X-Zerotune-Token": token}};
    if (body) init.body = JSON.stringify(body);
    const response = await fetch(url, init);
    answers.push({status: response.status, body: await response.text()});
  }
  return answers;
}"""
