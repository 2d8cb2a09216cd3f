"""The Python snippets of docs/metrics.md, by the framework they import, and the conformal recipe of each framework
guide, for the tests to run."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from masksembles_core import conformal, metrics

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOC = DOCS / "metrics.md"
CONFORMAL_RECIPE = "Conformal prediction from `predict`"
FRAMEWORK_IMPORTS = {"torch": "import torch", "keras": "import keras", "flax": "from flax import"}


def snippets(framework: str | None) -> list[str]:
    """The ```python blocks of docs/metrics.md that import ``framework``; None: those importing no framework."""
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    imported = [{name for name, line in FRAMEWORK_IMPORTS.items() if line in block} for block in blocks]
    wanted = set() if framework is None else {framework}
    return [block for block, names in zip(blocks, imported, strict=True) if names == wanted]


def run(blocks: list[str]) -> dict[str, object]:
    """Execute ``blocks`` in order in one namespace (as a reader pastes them); returns the namespace."""
    namespace: dict[str, object] = {"__name__": "docs_metrics"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def check_regression_snippet(framework: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``framework``'s snippet (a Masksembles regressor trained on the Gaussian NLL) runs as written: it prints the
    summary table, and its 4 members' means and variances on 256 points differ."""
    (block,) = snippets(framework)
    namespace = run([block])
    assert capsys.readouterr().out.startswith("| Metric | Value |\n|---|---:|\n| nll |")
    means, variances = np.asarray(namespace["means"]), np.asarray(namespace["variances"])
    assert means.shape == variances.shape == (4, 256)
    assert metrics.uncertainty_split(means, variances)[1].mean() > 0.0  # the members differ


def guide_section(framework: str, title: str) -> list[str]:
    """The Python blocks of the section ``## title`` of docs/``framework``.md, up to the next heading (a ``###``
    subsection is a section of its own)."""
    text = (DOCS / f"{framework}.md").read_text()
    section = re.split(r"\n#{2,6} ", text.split(f"\n## {title}\n", 1)[1], maxsplit=1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)


def check_conformal_recipe(framework: str, after: str | None = None) -> None:
    """docs/``framework``.md's conformal recipe runs as written (after the blocks of its section ``after``, whose
    model it uses): APS sets (8, 10) from ``predict``'s member logits, calibrated on 200 samples of 4 members."""
    blocks = [*(guide_section(framework, after) if after else []), *guide_section(framework, CONFORMAL_RECIPE)]
    namespace: dict[str, object] = {"__name__": f"guide_{framework}_conformal"}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/{framework}.md block {index}", "exec"), namespace)
    predictor, sets = namespace["predictor"], np.asarray(namespace["sets"])
    assert isinstance(predictor, conformal.ConformalSets)
    assert (predictor.members, predictor.classes, predictor.n_calibration) == (4, 10, 200)
    assert sets.shape == (8, 10) and sets.dtype == np.bool_
