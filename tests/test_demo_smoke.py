"""The main demo (examples/demo.py) in its tiny configuration: every file and every model row is produced.

Accuracy values are not checked: they belong to the report, not to tests.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.backends import requested_backends

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = (
    "toy_transition",
    "masks",
    "theory",
    "regression_toy",
    "diabetes_calibration",
    "corruptions",
    "reliability",
    "diversity",
)
TABLES = (
    "toy_entropy",
    "regression_toy",
    "diabetes_results",
    "digits_results",
    "digits_sweep",
    "digits_ood_scores",
    "digits_corruptions",
    "digits_shift",
    "regression_conformal",
    "digits_conformal",
)
DIGITS_MODELS = ["Single", "MC-Dropout", "Masksembles", "Masksembles 2.3×", "Deep Ensemble"]
REGRESSION_MODELS = ["Single", "MC-Dropout", "Masksembles", "Deep Ensemble"]
OOD_SCORES = [
    "predictive entropy",
    "mutual information",
    "1 − max probability",
    "− max logit",
    "energy",
    "variation ratio",
    "probability variance",
]
ONE_MEMBER_SCORES = ["predictive entropy", "1 − max probability", "− max logit", "energy"]
TOY_MODELS = [
    "Single",
    "Masksembles S=1.1",
    "Masksembles S=2",
    "Masksembles S=3",
    "Masksembles S=10",
    "Deep Ensemble",
]
SMOKE_SWEEP = [("MC-Dropout", "p=0.1"), ("MC-Dropout", "p=0.3"), ("Masksembles", "S=2"), ("Masksembles", "S=4")]
CORRUPTIONS = ["gaussian noise", "impulse noise", "gaussian blur", "contrast", "brightness"]


# the demo's --framework for each test backend (Keras runs on the backend KERAS_BACKEND names)
FRAMEWORKS = {
    "torch": "torch",
    "keras-tensorflow": "keras",
    "keras-jax": "keras",
    "keras-torch": "keras",
    "flax": "flax",
}
# The Keras demo runs the same code on every backend, and each Keras session's own tests cover its backend: it runs
# by default in the TensorFlow session only (60-100 s a run); the JAX and torch sessions run it with -m slow.
REQUESTED = requested_backends()
RUNS = [
    pytest.param(framework, marks=pytest.mark.slow)
    if framework == "keras" and "keras-tensorflow" not in REQUESTED
    else framework
    for framework in sorted({FRAMEWORKS[backend] for backend in REQUESTED if backend in FRAMEWORKS})
]


@pytest.mark.parametrize("framework", RUNS)
def test_the_demo_writes_every_file_and_row(framework: str, tmp_path: Path, subtests: pytest.Subtests) -> None:
    """One run of the demo per framework (one test, so that pytest-xdist runs it on one worker), every check of its
    output a subtest."""
    command = [sys.executable, str(DEMO), "--smoke", "--framework", framework, "--output", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in PLOTS:
        with subtests.test("plot", name=name):
            check_plot(tmp_path, name)
    for name in TABLES:
        with subtests.test("table", name=name):
            check_table(tmp_path, name)
    for check in CHECKS:
        with subtests.test(check.__name__):
            check(tmp_path)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def check_plot(output: Path, name: str) -> None:
    data = (output / f"{name}.png").read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def check_table(output: Path, name: str) -> None:
    """Written as Markdown and CSV, with the same rows."""
    markdown = (output / f"{name}.md").read_text()
    rows = read_csv(output / f"{name}.csv")
    assert rows
    assert markdown.count("\n|") == len(rows) + 2  # header, separator and one line per row


def toy_table_has_every_model(output: Path) -> None:
    rows = read_csv(output / "toy_entropy.csv")
    assert [row["Model"] for row in rows] == TOY_MODELS
    for row in rows:
        assert float(row["Entropy away from data mean"]) >= 0.0
        assert int(row["Parameters"]) > 0


def digits_table_has_every_model_and_column(output: Path) -> None:
    rows = read_csv(output / "digits_results.csv")
    assert [row["Model"] for row in rows] == [name for model in DIGITS_MODELS for name in (model, f"{model} + TS")]
    by_model = {row["Model"]: row for row in rows}
    columns = ("Accuracy", "NLL", "ECE", "Brier", "OOD AUROC (entropy)", "OOD AUPR (entropy)", "OOD FPR95 (entropy)")
    for model in by_model:
        for column in columns:
            assert 0.0 <= float(by_model[model][f"{column} mean"]) <= 10.0, (model, column)
        assert 0.0 <= float(by_model[model]["AURC ×10³ mean"]) <= 1000.0, model
        assert int(by_model[model]["Parameters"]) > 0
        assert float(by_model[model]["Train time (s) mean"]) > 0.0
    for model in by_model:  # mutual information needs more than one member
        assert (by_model[model]["OOD FPR95 (MI) mean"] == "") == model.startswith("Single"), model
    single = int(by_model["Single"]["Parameters"])
    assert by_model["Deep Ensemble"]["Parameters"] == str(4 * single)
    assert by_model["Masksembles"]["Parameters"] == str(single)  # fixed layer widths
    assert abs(int(by_model["Masksembles 2.3×"]["Parameters"]) / single - 2.3) < 0.02  # the paper's size
    assert [by_model[m]["Size"] for m in DIGITS_MODELS] == ["1.00×", "1.00×", "1.00×", "2.30×", "4.00×"]
    assert by_model["MC-Dropout"]["Picked on validation"].startswith("p=")
    assert by_model["Masksembles"]["Picked on validation"].startswith("S=")
    for model in DIGITS_MODELS:
        assert by_model[f"{model} + TS"]["Picked on validation"].startswith("T = "), model
        assert by_model[f"{model} + TS"]["Parameters"] == by_model[model]["Parameters"]


def ood_scores_table_has_every_score_a_model_gives(output: Path) -> None:
    rows = read_csv(output / "digits_ood_scores.csv")
    expected = [
        (model, score) for model in DIGITS_MODELS for score in (ONE_MEMBER_SCORES if model == "Single" else OOD_SCORES)
    ]
    assert [(row["Model"], row["Score"]) for row in rows] == expected
    for row in rows:
        assert 0.0 <= float(row["AUROC mean"]) <= 1.0 and 0.0 <= float(row["FPR95 mean"]) <= 1.0


def regression_tables_have_every_model(output: Path) -> None:
    toy = {row["Model"]: row for row in read_csv(output / "regression_toy.csv")}
    assert list(toy) == REGRESSION_MODELS
    for model, row in toy.items():
        assert 0.0 <= float(row["Test 90% coverage mean"]) <= 1.0
        assert float(row["Epistemic std on data mean"]) >= 0.0
        assert (row["Gap ÷ data mean"] == "") == (model == "Single"), model  # one member: no epistemic spread
    assert int(toy["Deep Ensemble"]["Parameters"]) == 4 * int(toy["Single"]["Parameters"])
    diabetes = {row["Model"]: row for row in read_csv(output / "diabetes_results.csv")}
    assert list(diabetes) == REGRESSION_MODELS
    for row in diabetes.values():
        for column in ("RMSE", "NLL", "NLL (exact mixture)", "90% coverage", "Calibration error"):
            assert row[f"{column} mean"] != "", column
    assert diabetes["MC-Dropout"]["Picked on validation"].startswith("p=")
    assert diabetes["Masksembles"]["Picked on validation"].startswith("S=")


def sweep_and_corruption_tables_cover_every_setting(output: Path) -> None:
    sweep = read_csv(output / "digits_sweep.csv")
    assert [(row["Method"], row["Setting"]) for row in sweep] == SMOKE_SWEEP
    corruptions = read_csv(output / "digits_corruptions.csv")
    assert {(row["Model"], row["Corruption"], row["Severity"]) for row in corruptions} == {
        (model, corruption, str(severity))
        for model in DIGITS_MODELS
        for corruption in CORRUPTIONS
        for severity in range(1, 6)
    }
    shift = read_csv(output / "digits_shift.csv")
    assert [(row["Model"], row["Metric"]) for row in shift] == [
        (model, metric) for model in DIGITS_MODELS for metric in ("accuracy", "ECE")
    ]
    assert all(row[f"Severity {s} mean"] != "" for row in shift for s in range(1, 6))


def summary_holds_every_table(output: Path) -> None:
    summary = (output / "results.md").read_text()
    for title in (
        "Toy transition",
        "Regression toy",
        "Diabetes",
        "Digits: in-distribution",
        "Digits: the validation sweeps",
        "Digits: OOD detection",
        "Digits under corruption",
        "Digits: conformal prediction sets",
        "Regression toy: conformal",
    ):
        assert title in summary
    assert "Wall time" in summary


def conformal_tables_have_every_model_score_and_alpha(output: Path) -> None:
    sets = read_csv(output / "digits_conformal.csv")
    assert [(row["Model"], row["Score"], row["α"]) for row in sets] == [
        (model, score, alpha)
        for model in DIGITS_MODELS
        for score in ("LAC", "APS", "RAPS")
        for alpha in ("0.1", "0.05")
    ]
    for row in sets:
        assert 0.0 <= float(row["Coverage mean"]) <= 1.0 and 0.0 <= float(row["Mean set size mean"]) <= 7.0
    intervals = read_csv(output / "regression_conformal.csv")
    assert [row["Model"] for row in intervals] == [model for model in REGRESSION_MODELS for _ in range(2)]
    for row in intervals:
        assert 0.0 <= float(row["Test coverage mean"]) <= 1.0 and float(row["Gap width mean"]) > 0.0
    absolute = [row for row in intervals if row["Interval"] == "μ ± q̂"]
    assert len(absolute) == len(REGRESSION_MODELS)
    for row in absolute:  # one width everywhere
        assert row["Test width mean"] == row["Gap width mean"]


CHECKS: tuple[Callable[[Path], None], ...] = (
    toy_table_has_every_model,
    digits_table_has_every_model_and_column,
    ood_scores_table_has_every_score_a_model_gives,
    regression_tables_have_every_model,
    sweep_and_corruption_tables_cover_every_setting,
    conformal_tables_have_every_model_score_and_alpha,
    summary_holds_every_table,
)
