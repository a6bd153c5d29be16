"""Templates: a filled form saved as <the user's folder>/experiment/<name>.yaml (only what differs from the
default job), which `zerotune train experiment=<name>` runs, and any experiment loaded back into the form
(the user's or a packaged one)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from zerotune.builder import form, preview
from zerotune.compose import compose
from zerotune.compose.experiment_file import (
    experiment_file,
    experiment_names,
    experiment_path,
    experiment_yaml,
    write_experiment,
)
from zerotune.errors import ConfigError

SAVED_BY = "Saved from the config builder page (zerotune builder)."


class ExperimentExists(FileExistsError):
    """Saving over an existing experiment needs the user's confirmation."""


def load(name: str) -> dict:
    """The form that gives experiment `name`: its group choices, the form's keys, and the rest as extra."""
    if experiment_file(name) is None:
        raise ConfigError("name", f"no experiment {name!r}", f"one of: {', '.join(experiment_names()) or '(none saved yet)'}")
    return {"name": name, **form.as_form([f"experiment={name}"])}


def save(name: str, choices: dict[str, str], values: dict[str, Any], extra: list[str], overwrite: bool) -> dict:
    path = experiment_path(name)
    if path.exists() and not overwrite:
        raise ExperimentExists(f"experiment {name!r} exists ({path.name}); confirm to overwrite it")
    overrides = form.overrides(choices, values, extra)
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


def _check_round_trip(name: str, overrides: list[str]) -> None:
    """The saved file must compose to the config the form composes; a file that does not is not kept."""
    from_file = OmegaConf.to_container(compose([f"experiment={name}"]), resolve=False)
    from_form = OmegaConf.to_container(compose(overrides), resolve=False)
    differ = sorted(k for k in set(from_file) | set(from_form) if from_file.get(k) != from_form.get(k))
    if differ:
        raise ConfigError("name", f"experiment {name!r} would not run what the form shows: {', '.join(differ)} "
                          f"differ from `{preview.command_line(overrides)}`", "report this; the file was not kept")
