"""Where metrics go besides the run directory: nothing (logger=none), W&B (logger=wandb, offline by default: the
training machines have no network; `wandb sync` later), TensorBoard (logger=tensorboard, event files under
<run dir>/tensorboard/), or both (logger=all), behind one interface so each stays optional."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from numbers import Real
from pathlib import Path
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


# logger.name -> the loggers it writes to (`all`: kohya's and SimpleTuner's word for both)
LOGGERS = {"none": (), "wandb": ("wandb",), "tensorboard": ("tensorboard",), "all": ("wandb", "tensorboard")}
TENSORBOARD_DIR = "tensorboard"  # under the run directory: `tensorboard --logdir outputs` finds every run


class FanOut(RunLogger):
    """Several loggers as one (logger=all)."""

    def __init__(self, loggers: list[RunLogger]):
        self.loggers = loggers

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def log_images(self, key: str, png_paths: list[str], step: int) -> None:
        for lg in self.loggers:
            lg.log_images(key, png_paths, step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_summary(summary)

    def finish(self, exit_code: int = 0) -> None:
        for lg in self.loggers:
            lg.finish(exit_code)


def make_logger(cfg: Config, run_dir: str, name: str, group: str | None, is_main: bool) -> RunLogger:
    """Only rank 0 logs; the other ranks get a logger that drops everything."""
    names = LOGGERS[cfg.logger.name] if is_main else ()
    lg = cfg.logger
    made: list[RunLogger] = []
    if "wandb" in names:
        made.append(WandbLogger(project=lg.project, run_dir=run_dir, config=as_dict(cfg), name=name, group=group,
                                mode=lg.mode, tags=list(lg.tags), entity=lg.entity))
    if "tensorboard" in names:
        made.append(TensorBoardLogger(os.path.join(run_dir, TENSORBOARD_DIR), config=as_dict(cfg)))
    return NullLogger() if not made else made[0] if len(made) == 1 else FanOut(made)


def check_logger(logger_cfg: Logger) -> None:
    """For the job's parent: what would stop a logger in a worker (a missing package, W&B's credentials), found in
    a second."""
    names = LOGGERS.get(logger_cfg.name)
    if names is None:
        raise ConfigError("logger.name", f"unknown logger {logger_cfg.name!r}", "logger.name=tensorboard, or "
                          "logger.name=wandb, or logger.name=all (both), or logger.name=none")
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logger", f"logger={logger_cfg.name} writes TensorBoard's event files, which needs the "
                          "tensorboard package, not installed", "pip install 'zerotune[tensorboard]', or logger=none")
    if "wandb" not in names:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger", f"logger={logger_cfg.name} needs the wandb package, which is not installed",
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


class TensorBoardLogger(RunLogger):
    """The run's scalars, validation images and summary as event files, written by torch's SummaryWriter (the
    tensorboard package's writer underneath)."""

    def __init__(self, log_dir: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer: Any = SummaryWriter(log_dir=log_dir)
        self.writer.add_text("config", _as_markdown(config), 0)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Every number (metrics.jsonl's row); a missing figure (None: unmeasured here) is left out, as are texts."""
        if self.writer is None:
            return
        for key, value in flatten(metrics).items():
            if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, float(value), step)

    def log_images(self, key: str, png_paths: list[str], step: int) -> None:
        """One image per file under `key`; several (a prompt with the EMA's weights beside) as `key/<file stem>`."""
        if self.writer is None or not png_paths:
            return
        import numpy as np
        from PIL import Image

        for path in png_paths:
            tag = key if len(png_paths) == 1 else f"{key}/{Path(path).stem}"
            pixels = np.asarray(Image.open(path).convert("RGB"))
            self.writer.add_image(tag, pixels, step, dataformats="HWC")

    def log_summary(self, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.add_text("summary", _as_markdown(summary), 0)

    def finish(self, exit_code: int = 0) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()


def _as_markdown(values: dict[str, Any]) -> str:
    """TensorBoard's text plugin renders markdown: the JSON as a code block keeps its layout."""
    return "```\n" + json.dumps(values, indent=1, default=str) + "\n```"
