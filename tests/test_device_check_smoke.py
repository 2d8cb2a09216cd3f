"""benchmarks/device_check.py --smoke on CPU: every section reports numbers or why it could not, and a failing section
stops nothing else. Run by the torch and flax sessions; each requires the sections of its framework to have run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.backends import requested_backends

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_check.py"
SECTIONS = (
    "environment", "conformance-torch", "conformance-jax", "conformance-keras", "layer-speed-torch",
    "layer-speed-jax", "cuda-choices", "training-step", "pack-torch", "pack-nnx",
)  # fmt: skip
# the sections a session testing this backend must see run (the rest report their framework as not importable)
REQUIRED = {
    "torch": {"conformance-torch", "layer-speed-torch", "cuda-choices", "training-step", "pack-torch"},
    "flax": {"conformance-jax", "layer-speed-jax", "pack-nnx"},
}
UNLIMITED = "1e9"  # seconds: what runs must not depend on how busy the machine is
# one conformance and one speed section per backend, for the short runs
SHORT = {"torch": ("conformance-torch", "layer-speed-torch"), "flax": ("conformance-jax", "layer-speed-jax")}


def backend() -> str:
    tested = [name for name in REQUIRED if name in requested_backends()]
    if not tested:
        pytest.skip(f"needs the torch or flax backend (MASKSEMBLES_TEST_BACKENDS={requested_backends()})")
    return tested[0]


def run(out: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    """The script in --smoke mode writing to ``out``: (the process, the JSON report, the Markdown report)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *options]
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    return process, json.loads((out / "device_check.json").read_text()), (out / "device_check.md").read_text()


def sections_by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {section["name"]: section for section in report["sections"]}


def numbers(section: dict[str, Any]) -> list[float]:
    return [
        value
        for row in section["rows"]
        for value in row.values()
        if isinstance(value, int | float) and not isinstance(value, bool)
    ]


def assert_measured(section: dict[str, Any]) -> None:
    """Status ok, rows with numbers, no part failed and none skipped."""
    assert section["status"] == "ok", (section["name"], section["status"], section["error"])
    assert numbers(section), f"{section['name']} has no numbers: {section['rows']}"
    assert not [row for row in section["rows"] if "error" in row], section["rows"]
    assert not section["skipped"], section["skipped"]


def test_a_full_smoke_run(tmp_path: Path, subtests: pytest.Subtests) -> None:
    """One run without a budget (one test, so that pytest-xdist runs it on one worker): every section reports
    numbers or why it could not, and the conformance section finds every value bit-identical."""
    backend()  # skips before the run when neither torch nor flax is tested
    process, report, markdown = run(tmp_path, "--budget-s", UNLIMITED)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    with subtests.test("every section reports numbers or a reason"):
        check_sections(report, markdown)
    with subtests.test("conformance finds every value bit-identical"):
        check_conformance(report)


def check_sections(report: dict[str, Any], markdown: str) -> None:
    found = sections_by_name(report)
    assert tuple(found) == SECTIONS
    for name in REQUIRED[backend()] | {"environment"}:
        assert_measured(found[name])
    for name, section in found.items():
        assert f"(`{name}`)" in markdown
        if section["status"] == "unavailable":
            assert any(note.startswith("Not importable: ") for note in section["notes"]), section["notes"]
        else:
            assert_measured(section)


def check_conformance(report: dict[str, Any]) -> None:
    conformance = SHORT[backend()][0]
    rows = sections_by_name(report)[conformance]["rows"]
    counts = [
        row[key] for row in rows for key in ("mismatches", "output mismatches", "gradient mismatches") if key in row
    ]
    assert len(counts) >= len(rows) and not any(counts), rows


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    conformance, speed = SHORT[backend()]
    sections = f"environment,{conformance},{speed}"
    process, report, markdown = run(tmp_path, "--sections", sections, "--fail", conformance, "--budget-s", UNLIMITED)
    assert process.returncode == 1
    found = sections_by_name(report)
    assert found[conformance]["status"] == "error"
    assert found[conformance]["error"]["type"] == "RuntimeError"
    assert found[conformance]["error"]["message"] == f"failure injected by --fail {conformance}"
    assert f"Error: `RuntimeError: failure injected by --fail {conformance}`" in markdown
    assert_measured(found[speed])
    others = set(SECTIONS) - {"environment", conformance, speed}
    assert {found[name]["status"] for name in others} == {"not selected (--sections)"}


def test_a_spent_budget_skips_the_sections_left(tmp_path: Path) -> None:
    conformance, speed = SHORT[backend()]
    process, report, _ = run(tmp_path, "--sections", f"environment,{conformance},{speed}", "--budget-s", "0")
    assert process.returncode == 0
    found = sections_by_name(report)
    assert_measured(found["environment"])
    for name in (conformance, speed):
        assert found[name]["status"] == "skipped"
        assert found[name]["notes"] == ["The time budget (--budget-s) was spent before this section."]
        assert not found[name]["rows"]
