"""bench/data/published_specdec.csv: columns present, every row sourced, numbers positive and consistent."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)
CSV = Path(__file__).resolve().parents[1] / "bench" / "data" / "published_specdec.csv"
COLUMNS = ["source_url", "where_in_source", "read_via", "date", "engine", "engine_version", "model", "model_class",
           "gpu", "tp", "drafter", "drafter_settings", "batch", "operating_point", "baseline_tok_s", "spec_tok_s",
           "speedup", "measured"]
NUMERIC = ("baseline_tok_s", "spec_tok_s", "speedup")


def _rows() -> list[dict]:
    with open(CSV, newline="") as f:
        r = csv.DictReader(f)
        assert r.fieldnames == COLUMNS
        return list(r)


def test_columns_and_every_row_sourced():
    rows = _rows()
    assert len(rows) >= 10
    for i, row in enumerate(rows):
        assert None not in row.values(), f"row {i}: wrong number of fields"
        assert row["source_url"].startswith("https://"), i
        for col in ("where_in_source", "read_via", "date", "engine", "model", "gpu", "drafter", "measured"):
            assert row[col].strip(), f"row {i}: {col} empty"
        assert row["model_class"] in ("dense", "moe"), i


def test_numbers_positive_and_speedup_consistent():
    for i, row in enumerate(_rows()):
        vals = {k: float(row[k]) for k in NUMERIC if row[k]}
        assert "speedup" in vals, f"row {i}: no speedup"
        assert all(v > 0 for v in vals.values()), i
        if "baseline_tok_s" in vals and "spec_tok_s" in vals:
            ratio = vals["spec_tok_s"] / vals["baseline_tok_s"]
            assert abs(ratio - vals["speedup"]) <= 0.01 * ratio + 0.005, f"row {i}: speedup {vals['speedup']} != {ratio}"
        if row["batch"]:
            assert int(row["batch"]) >= 1, i
        else:
            assert row["operating_point"].strip(), f"row {i}: neither batch nor operating point"


def test_covers_dense_and_moe_at_batch_one_and_above():
    rows = _rows()
    batches = {(r["model_class"], int(r["batch"])) for r in rows if r["batch"]}
    assert {c for c, _ in batches} == {"dense", "moe"}
    assert any(b == 1 for _, b in batches) and any(b >= 32 for _, b in batches)
    assert all(r["gpu"].startswith(("H100", "H200", "not stated")) for r in rows)
