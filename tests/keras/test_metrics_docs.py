"""docs/metrics.md: the keras snippet (a Masksembles regressor trained on the Gaussian NLL) runs as written."""

from __future__ import annotations

import numpy as np
import pytest

from masksembles_core import metrics
from tests.metrics_docs import run, snippets


def test_keras_snippet_runs(capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = snippets("keras")
    namespace = run([block])
    assert capsys.readouterr().out.startswith("| Metric | Value |\n|---|---:|\n| nll |")
    means, variances = np.asarray(namespace["means"]), np.asarray(namespace["variances"])
    assert means.shape == variances.shape == (4, 256)
    assert metrics.uncertainty_split(means, variances)[1].mean() > 0.0  # the members differ
