"""Run loggers: where per-step metrics, images and the final summary go."""

from zerotune.loggers.base import NullLogger, RunLogger

__all__ = ["NullLogger", "RunLogger"]
