"""Where metrics go besides the run directory: nothing (logger=none) or W&B (logger=wandb, offline by default:
the training machines have no network; `wandb sync` later), behind one interface so W&B stays optional."""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, get_args

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config, Logger, as_dict


class RunLogger(ABC):
    """Metrics arrive already namespaced (`loss/...`, `memory/...`, `perf/...`, `train/...`)."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None: ...

    @abstractmethod
    def log_images(self, key: str, png_paths: list[str], step: int) -> None: ...

    @abstractmethod
    def log_summary(self, summary: dict[str, Any]) -> None:
        """Final, per-run values (peaks, throughput, environment); nested dicts allowed."""

    @abstractmethod
    def finish(self, exit_code: int = 0) -> None:
        """Closes the run; must be safe to call more than once."""

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(0 if exc_type is None else 1)


class NullLogger(RunLogger):
    """Discards everything (logging disabled, or non-zero ranks)."""

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_images(self, key: str, png_paths: list[str], step: int) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def make_logger(cfg: Config, run_dir: str, name: str, group: str | None, is_main: bool) -> RunLogger:
    """Only rank 0 talks to W&B; the other ranks get a logger that drops everything."""
    if cfg.logger.name == "none" or not is_main:
        return NullLogger()


    lg = cfg.logger
    return WandbLogger(project=lg.project, run_dir=run_dir, config=as_dict(cfg),
                       name=name, group=group, mode=lg.mode, tags=list(lg.tags), entity=lg.entity)


def check_logger(logger_cfg: Logger) -> None:
    """For the job's parent: what would stop W&B at wandb.init in a worker, found in a second."""
    if logger_cfg.name != "wandb":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger", "logger=wandb needs the wandb package, which is not installed",
                          "pip install wandb (or zerotune[wandb]), or logger=none")
    from wandb.errors import AuthenticationError



    mode = logger_cfg.mode
    if mode not in known_modes():
        raise ConfigError("logger.mode", f"wandb has no mode {mode!r} (it has {', '.join(known_modes())})",
                          "logger.mode=offline, or online after `wandb login`")
    if mode in LOCAL_MODES:
        return
    try:
        found = api_key_found()
    except AuthenticationError as exc:
        raise ConfigError("logger.mode", f"mode {mode} needs a valid W&B API key: {exc}",
                          "`wandb login`, or logger.mode=offline") from None
    if not found:
        raise ConfigError("logger.mode", f"mode {mode} logs to the W&B server and needs an API key; none is "
                          "configured (no WANDB_API_KEY, no .netrc entry for the W&B host, nothing in wandb's "
                          "settings), so wandb.init would fail in the worker", "`wandb login`, or logger.mode=offline")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a/b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


# wandb.init modes that never reach the server, so need no API key.
LOCAL_MODES = ("offline", "dryrun", "disabled")


def known_modes() -> tuple[str, ...]:
    """The modes wandb.init accepts, from its own settings type."""
    from wandb.sdk.wandb_settings import Settings

    return get_args(Settings.model_fields["mode"].annotation)


def api_key_found() -> bool:
    """Whether wandb.init will find credentials, by wandb's own lookup (no prompt, no network). An API key of the
    wrong form raises wandb's AuthenticationError."""
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth

    host = wandb_setup.singleton().settings.base_url
    found = wbauth.authenticate_session(host=host, source="zerotune", prompt=False, update_session=False)
    return found is not None


class WandbLogger(RunLogger):
    def __init__(
        self,
        project: str,
        run_dir: str | os.PathLike[str],
        config: dict[str, Any],
        name: str,
        group: str | None,
        mode: str = "offline",
        tags: Iterable[str] = (),
        entity: str | None = None,
    ) -> None:
        import wandb  # optional dependency: imported only when W&B logging is on

        self._wandb = wandb
        run_dir = os.fspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)  # wandb falls back to a temp dir if `dir` does not exist
        self.run: Any = wandb.init(
            project=project,
            entity=entity,
            dir=run_dir,
            mode=mode,  # type: ignore[arg-type]  # wandb.init takes every mode its Settings does (known_modes); its signature names four
            config=config,
            name=name,
            group=group,
            tags=list(tags),
        )

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        # No commit: calls for one step merge into one history row, written when the step advances or at finish().
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def log_images(self, key: str, png_paths: list[str], step: int) -> None:
        if self.run is not None and png_paths:
            self.run.log({key: [self._wandb.Image(os.fspath(p)) for p in png_paths]}, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(flatten(summary))

    def finish(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=exit_code)
