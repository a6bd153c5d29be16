"""The page's files: experiments saved from a filled form (what differs from the default job) and loaded back (what
the page may not write shown, never saved over); a pasted DeepSpeed JSON or accelerate YAML imported as overrides
(parsed as data, never run); and the sweeps under multirun/ and outputs/ with their reports."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from zerotune.builder import form, preview
from zerotune.builder import form as allowed
from zerotune.builder.access import RESULT_ROOTS, imports_dir, inside_results, project, shown
from zerotune.config.compose import (
    composed,
    experiment_file,
    experiment_names,
    experiment_path,
    experiment_yaml,
    write_experiment,
)
from zerotune.config.compose.overrides import check_pure_value, override
from zerotune.config.errors import ConfigError
from zerotune.plan.import_config import overrides_for
from zerotune.report.build import build_report
from zerotune.report.collect import NoRunsError, find_sweeps, job_dirs
from zerotune.report.table import NA_NOTE, PLAN_NOTE, table_cells

SAVED_BY = "Saved from the config builder page (zerotune builder)."


class ExperimentExists(FileExistsError):
    """Saving over an existing experiment needs the user's confirmation."""


def load(name: str) -> dict:
    """The form that gives experiment `name`: its group choices, the form's keys, the rest as extra (the run
    and sweep folders among them), and `not_editable`: what the file holds that the page may not write."""
    file = experiment_file(name)
    if file is None:
        raise ConfigError("name", f"no experiment {name!r}", f"one of: {', '.join(experiment_names()) or '(none saved yet)'}")
    loaded = form.as_form([f"experiment={name}"])
    held = held_overrides(file)
    refusals = {line: allowed.refusal(line) for line in [*held, *loaded["extra"]]}
    not_editable: dict[str, dict] = {}  # by key: the file's line and the composed one name the same key
    for line, refused in refusals.items():
        if refused is not None:
            not_editable.setdefault(refused.key, {"key": refused.key, "override": line, "problem": refused.problem})
    # Composing drops Hydra's keys: the run and sweep folders are read from the file, as extra the page edits.
    folders = [line for line in held if line.startswith("hydra.") and refusals[line] is None]
    extra = [line for line in loaded["extra"] if refusals[line] is None] + folders
    return {"name": name, **loaded, "extra": extra, "not_editable": list(not_editable.values())}


def save(name: str, choices: dict[str, str], values: dict[str, Any], extra: list[str], overwrite: bool) -> dict:
    path = experiment_path(name)
    overrides = form.overrides(choices, values, extra)
    if path.exists():
        _check_holds_only_configuration(name, path)  # before asking to overwrite: it would be refused anyway
        if not overwrite:
            raise ExperimentExists(f"experiment {name!r} exists ({path.name}); confirm to overwrite it")
    text = experiment_yaml(overrides, [SAVED_BY])
    previous = path.read_text() if path.exists() else None
    write_experiment(path, text)
    try:
        _check_round_trip(name, overrides)
    except BaseException:  # a refusal or a failure: either way no file that may not run what the form shows
        if previous is None:
            path.unlink()
        else:
            path.write_text(previous)
        raise
    return {"name": name, "path": str(path), "overrides": overrides, "command": preview.command_line([f"experiment={name}"])}


def held_overrides(path: Path) -> list[str]:
    """What an experiment file sets, as overrides: each leaf of its keys (`hydra.callbacks.x._target_=...`) and
    each `group=option` its defaults list chooses (`hydra/launcher=slurm`). A file YAML cannot read sets none."""
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return []
    if not isinstance(body, dict):
        return []
    chosen = [override(group.split()[-1].lstrip("/"), option) for entry in body.get("defaults") or []
              if isinstance(entry, dict) for group, option in entry.items()]  # `override /hydra/launcher: slurm`
    return chosen + [override(k, v) for k, v in _leaves({k: v for k, v in body.items() if k != "defaults"})]


def _leaves(node: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _check_holds_only_configuration(name: str, path: Path) -> None:
    """The page writes configuration only: saving over a file that holds more would drop it."""
    held = [refused.key for refused in map(allowed.refusal, held_overrides(path)) if refused is not None]
    if held:
        raise ConfigError("name", f"experiment {name!r} ({path}) holds {', '.join(held)}, which the page does not "
                          "write: saving over it would drop them",
                          f"save under another name (that file holds what the page shows, without them), or edit {path} "
                          "yourself")


def _check_round_trip(name: str, overrides: list[str]) -> None:
    """The saved file must compose to the config the form composes; a file that does not is not kept."""
    from_file = composed([f"experiment={name}"]).tree()
    from_form = composed(overrides).tree()
    differ = sorted(k for k in set(from_file) | set(from_form) if from_file.get(k) != from_form.get(k))
    if differ:
        raise ConfigError("name", f"experiment {name!r} would not run what the form shows: {', '.join(differ)} "
                          f"differ from `{preview.command_line(overrides)}`", "report this; the file was not kept")


def import_text(text: str) -> dict:
    kind, suffix, parsed = _kind(text)
    # Its strings become config values: a "${oc.env:...}" in them would be read when they are composed.
    check_pure_value("import", parsed, fix="put the value itself in the pasted file, in place of the ${...}")
    # import_config reads files, and a DeepSpeed JSON it cannot fully express stays in the overrides as
    # deepspeed.config_file=<path>: the text is kept under outputs/, named by its content.
    folder = imports_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"
    kept_before = path.exists()  # the same text, imported before: named by its content, so left as it is
    if not kept_before:
        path.write_text(text)
    try:
        overrides, differ = overrides_for(path)
    except BaseException:
        if not kept_before:
            path.unlink(missing_ok=True)  # a refused paste (a credentials file, say) is not kept on disk
        raise
    return {"kind": kind, "file": str(path), "overrides": overrides, "no_equivalent": differ, **form.as_form(overrides)}


def _kind(text: str) -> tuple[str, str, Any]:
    """("deepspeed" | "accelerate", the file suffix, the parsed data)."""
    stripped = text.lstrip()
    if not stripped:
        raise ConfigError("import", "nothing was pasted", "paste a DeepSpeed JSON or an accelerate config YAML")
    if stripped.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("import", f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                              "fix the JSON there (a trailing comma or a missing quote, often)") from None
        if not isinstance(parsed, dict):
            raise ConfigError("import", "the JSON is not an object", "paste a DeepSpeed config: {\"zero_optimization\": ...}")
        return "deepspeed", ".json", parsed
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("import", f"malformed YAML{where}: {getattr(exc, 'problem', None) or exc}",
                          "fix the YAML there") from None
    if not isinstance(parsed, dict) or not ({"compute_environment", "distributed_type", "deepspeed_config"} & set(parsed)):
        raise ConfigError("import", "neither a DeepSpeed JSON nor an accelerate config YAML",
                          "paste a DeepSpeed JSON ({...}) or what `accelerate config` wrote (default_config.yaml)")
    return "accelerate", ".yaml", parsed


SERVED = (".png", ".csv", ".md")  # what /api/file hands out from a results folder


def sweeps() -> list[dict]:
    """Newest first: every folder of jobs below multirun/ and outputs/ (two levels, as Hydra names them)."""
    found = []
    for root in RESULT_ROOTS:
        base = project() / root
        if base.is_dir():
            found += find_sweeps(base)
    return [{"folder": shown(s), "jobs": len(job_dirs(s))} for s in sorted(found, key=shown, reverse=True)]


def open_sweep(folder: str, budget_mib: float | None) -> dict:
    path = inside_results(folder)
    try:
        report = build_report([path], budget_mib=budget_mib)
    except (FileNotFoundError, NoRunsError) as exc:
        raise ConfigError("folder", str(exc), "pick a sweep from the list") from None
    headers, body = table_cells(report.rows, report.keys)
    return {"folder": shown(path), "headers": headers, "rows": body, "notes": f"{NA_NOTE} {PLAN_NOTE}",
            "budget": report.budget.reason if report.budget else None,
            "plots": [{"title": p.title, "file": shown(p.path), "note": p.note} for p in report.plots]}


def served_file(relative: str) -> Path:
    path = inside_results(relative, key="file")
    if path.suffix not in SERVED or not path.is_file():
        raise ConfigError("file", f"{relative!r} is not a report file", f"one of the sweep's {', '.join(SERVED)} files")
    return path
