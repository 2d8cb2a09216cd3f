"""docs/metrics.md: the NumPy-only snippets run, in order, as a reader pastes them."""

from __future__ import annotations

import numpy as np
import pytest

from masksembles_core import conformal, metrics
from tests.metrics_docs import DOC, run, snippets

DOC_TEXT = DOC.read_text()


def test_numpy_snippets_run(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = snippets(None)
    assert len(blocks) >= 5
    namespace = run(blocks)
    printed = capsys.readouterr().out
    assert printed.startswith("| Metric | Value |\n|---|---:|\n| accuracy |")
    summary = namespace["table"]
    assert isinstance(summary, metrics.Summary) and "ood_fpr95_energy" in summary
    # what the text says about the stand-ins holds for them: overconfident logits, fixed by the temperature
    assert isinstance(namespace["temperature"], float) and namespace["temperature"] > 1.5
    y_test = np.asarray(namespace["y_test"])
    before, after = np.asarray(namespace["before"]), np.asarray(namespace["after"])
    assert metrics.negative_log_likelihood(after, y_test) < metrics.negative_log_likelihood(before, y_test)
    assert metrics.expected_calibration_error(after, y_test) < metrics.expected_calibration_error(before, y_test)
    assert "close to 2" in DOC_TEXT and abs(metrics.fit_temperature(*binary_stand_in(namespace)) - 2.0) < 0.3
    assert np.asarray(namespace["per_member"]).shape == (4,)
    covered, alone = namespace["covered"], namespace["alone"]
    assert isinstance(covered, float) and isinstance(alone, float) and covered > alone
    # the conformal section: the stated coverage, and the normalized intervals narrower than the absolute ones
    sets = np.asarray(namespace["sets"])
    assert sets.shape == (2000, 10) and sets.dtype == np.bool_
    assert abs(conformal.coverage(sets, y_test) - 0.9) < 0.03
    widths = namespace["widths"]
    assert isinstance(widths, dict) and widths["normalized"] < widths["absolute"]
    assert "ConformalSets(score='aps', alpha=0.1, threshold=" in printed and "n_calibration=1000" in printed


def binary_stand_in(namespace: dict[str, object]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(namespace["z"])[:, None], np.asarray(namespace["y_binary"])
