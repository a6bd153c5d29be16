"""Templates: a filled form saved as <the user's folder>/experiment/<name>.yaml (only what differs from the
default job), which `zerotune train experiment=<name>` runs, and any experiment loaded back into the form
(the user's or a packaged one). What a file holds that the page may not write (allowed.py: a callback, Hydra's
settings) is shown on loading, not editable; the page never saves over a file that holds such keys, which
its save would drop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from zerotune.builder import allowed, form, preview
from zerotune.compose import compose
from zerotune.compose.experiment_file import (
    experiment_file,
    experiment_names,
    experiment_path,
    experiment_yaml,
    write_experiment,
)
from zerotune.compose.overrides import override
from zerotune.errors import ConfigError

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
    from_file = OmegaConf.to_container(compose([f"experiment={name}"]), resolve=False)
    from_form = OmegaConf.to_container(compose(overrides), resolve=False)
    assert isinstance(from_file, dict) and isinstance(from_form, dict)  # a composed config's container is a dict
    differ = sorted(k for k in set(from_file) | set(from_form) if from_file.get(k) != from_form.get(k))
    if differ:
        raise ConfigError("name", f"experiment {name!r} would not run what the form shows: {', '.join(differ)} "
                          f"differ from `{preview.command_line(overrides)}`", "report this; the file was not kept")
