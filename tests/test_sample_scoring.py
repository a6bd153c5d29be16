"""The digit accuracy a run reports is the classifier's verdict on that run's own samples: the samples are
saved beside the grid (samples/samples.npz), scoring them again gives the recorded figures, and the grid is
drawn from the same tensors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.helpers.cli import read_summary, run_cli
from zerotune.train.evaluate import DigitClassifier, load_samples, save_grid


def rescored(run_dir) -> tuple[dict, float, dict[str, float]]:
    summary = read_summary(run_dir)
    quality = summary["quality"]
    images, labels = load_samples(run_dir / quality["samples_file"])
    clf = DigitClassifier()
    per_class = {str(k): v for k, v in clf.per_class_accuracy(images, labels).items()}
    return summary, clf.accuracy(images, labels), per_class


def test_the_recorded_accuracy_is_the_score_of_the_saved_samples(default_job_run):
    run_dir, _ = default_job_run
    summary, accuracy, per_class = rescored(run_dir)
    quality = summary["quality"]
    images, labels = load_samples(run_dir / quality["samples_file"])
    assert len(images) == len(labels) == quality["samples"] == 10 * 2  # evaluate.per_class=2 in the fixture
    assert np.array_equal(np.sort(labels), np.repeat(np.arange(10), 2))
    assert quality["digit_accuracy"] == accuracy
    assert quality["per_class_accuracy"] == per_class


def test_the_grid_shows_the_scored_samples(default_job_run, tmp_path):
    run_dir, summary = default_job_run
    images, labels = load_samples(run_dir / summary["quality"]["samples_file"])
    again = save_grid(images, labels, tmp_path / "grid.png", nrow=2)
    assert np.array_equal(np.asarray(Image.open(again)), np.asarray(Image.open(run_dir / summary["quality"]["grid"])))


def test_the_score_follows_the_samples_not_the_run(default_job_run):
    """Claimed as other digits, the same samples score what the classifier says of them: nothing is fixed."""
    run_dir, summary = default_job_run
    images, labels = load_samples(run_dir / summary["quality"]["samples_file"])
    clf = DigitClassifier()
    predicted = clf.predict(images)
    assert clf.accuracy(images, predicted) == 1.0
    assert clf.accuracy(images, (predicted + 1) % 10) == 0.0


@pytest.mark.slow
def test_the_default_job_draws_digits_a_classifier_reads(tmp_path):
    """`python train.py` as typed: at least 99% of its 500 samples are read as the digit asked for, and that
    figure is the score of the samples it saved (README and docs/results.md: the default job)."""
    run_dir = tmp_path / "run"
    proc = run_cli(f"hydra.run.dir={run_dir}", "checkpoint.final=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, accuracy, per_class = rescored(run_dir)
    assert summary["quality"]["samples"] == 500
    assert summary["quality"]["digit_accuracy"] == accuracy >= 0.99
    assert summary["quality"]["per_class_accuracy"] == per_class
    assert "since the command started" in proc.stderr + proc.stdout
