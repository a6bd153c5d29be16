"""The logger interface the trainer talks to, so W&B stays optional."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any


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
