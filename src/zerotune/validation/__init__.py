"""Validation prompts (the `validation` block of conf/config.yaml): what they are and whether a run's settings are
sound, before any model exists. The passes themselves run in training (training/validation.py)."""

from __future__ import annotations

from zerotune.validation.prompts import ValidationPrompt, check_validation, enabled, weights_to_sample

__all__ = ["ValidationPrompt", "check_validation", "enabled", "weights_to_sample"]
