"""Sweep reports: one table, a few plots and a budget answer for a Hydra sweep of zerotune runs. This module imports
no plotting library, so registering the report callback (zerotune.cli.callbacks) costs a training run nothing."""

from zerotune.report.budget import BudgetAnswer, budget_answer, cheapest_fit
from zerotune.report.collect import NoRunsError, collect_runs, swept_keys

__all__ = ["BudgetAnswer", "NoRunsError", "budget_answer", "cheapest_fit", "collect_runs", "swept_keys"]
