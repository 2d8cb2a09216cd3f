"""benchmarks/bench_real_models.py --smoke: a tiny BERT (masks by ``convert_dropout``) measured at batch 1 and 2, both
programs checked against ``predict`` on the whole batch, and ``--combine`` making the table from the run's JSON without
touching BENCHMARKS.md, so the script cannot rot between its (hour-long) real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.backends import requested_backends

if "transformers" not in requested_backends():
    pytest.skip(
        f"backend 'transformers' not requested (MASKSEMBLES_TEST_BACKENDS={requested_backends()})",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_real_models.py"
ROW = "| BERT-tiny (smoke) (convert_dropout) |"


def script(*options: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(SCRIPT), *options]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


@pytest.mark.slow  # about 30 s on the loaded 2-core machine (two pack builds of each program, a subprocess each)
def test_smoke_run_checks_both_programs_and_combine_prints_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    measured = script("--smoke", "--out", str(out), "--threads", "1")
    assert measured.returncode == 0, measured.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2]
    bound = float(np.sqrt(np.finfo(np.float32).eps))
    for row in rows:
        assert set(row["seconds"]) == {"single", "predict", "packed", "auto"}
        assert all(value > 0 for value in row["seconds"].values())
        assert row["error"] <= bound and row["auto_error"] <= bound
        assert row["output_scale"] > 1e-20, "a check of outputs that are all (nearly) zero says nothing"
        assert row["layers"] > 0 and 0 < row["macs"]["packed"] < row["macs"]["dense"]
        assert row["auto"]["program"] in {"packed", "dense"}
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    table = script("--combine", str(out), "--no-write")
    assert table.returncode == 0, table.stderr[-3000:]
    assert "## Real models (torch)" in table.stdout
    assert [line.split("|")[2].strip() for line in table.stdout.splitlines() if line.startswith(ROW)] == ["1", "2"]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
