"""README.md's Configuration and Metrics tables name every setting of router.settings.Settings and every metric
of router.metrics.Metrics, and nothing else: a new setting or metric without its row fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.metrics import Metrics
from router.settings import OLD_NAMES, Settings

pytestmark = pytest.mark.timeout(30)

README = Path(__file__).resolve().parents[1] / "README.md"


def _first_column_names(section: str) -> set[str]:
    """The backticked names in the first column of the table under `## {section}`."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    rows = [line for line in text[start:end].splitlines() if line.startswith("| `")]
    assert rows, f"no table under ## {section}"
    return {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}


def test_the_settings_table_names_every_setting():
    shown = _first_column_names("Configuration")
    assert sorted(set(Settings.model_fields) - shown) == [], "settings without a README row"
    assert sorted(shown - set(Settings.model_fields) - set(OLD_NAMES)) == [], "README rows of no setting"


def test_the_metrics_table_names_every_metric():
    registry = CollectorRegistry()
    Metrics(registry)
    # prometheus_client names a counter's family without its _total suffix
    declared = {f.name + "_total" if f.type == "counter" else f.name for f in registry.collect()}
    assert "router_k8s_discovery_errors_total" in declared
    shown = _first_column_names("Metrics")
    assert sorted(declared - shown) == [], "metrics without a README row"
    assert sorted(shown - declared) == [], "README rows of no metric"
