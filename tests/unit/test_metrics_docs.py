"""docs/metrics.md against the product: the DCGM table is the catalogue, every agent metric it names is served and
every one served is named, and the alert table is the shipped rules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from agent.telemetry.fields import FIELDS
from tests.builders import scrape_metrics

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"
RULES = REPO / "daemonset" / "monitoring" / "gpu-node-agent-rules.yaml"


def doc() -> str:
    return METRICS_DOC.read_text()


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells, backticks dropped) of the first table under a heading."""
    text = doc().split(heading, 1)[1]
    rows = []
    started = False
    for line in text.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip().replace("`", "") for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= {"-"}:
                rows.append(cells)
        elif started:
            break
    return rows[1:]


@pytest.fixture(scope="module")
def exposition() -> str:
    return scrape_metrics()


def test_the_dcgm_table_is_the_catalogue() -> None:
    rows = table_after("## dcgm-exporter's family")
    expected = [[f.name, f.kind, f.unit or "—", "yes" if f.scope == "gpu+mig" else "no", f.nvml.replace("|", "/")]
                for f in FIELDS]
    assert rows == expected


def test_every_dcgm_metric_served_is_documented(exposition: str) -> None:
    served = set(re.findall(r"^# TYPE (DCGM_FI_\w+) ", exposition, re.M))
    assert len(served) == 25
    assert served == {f.name for f in FIELDS if f.kind != "label"}


def test_the_agents_table_names_exactly_the_families_it_serves(exposition: str) -> None:
    served = {name.removesuffix("_total") if kind == "counter" else name
              for name, kind in re.findall(r"^# TYPE (gpu_agent_\w+) (\w+)", exposition, re.M)}
    served = {n.removesuffix("_created") for n in served}
    documented = {row[0].removesuffix("_total") for row in table_after("## The agent's family")}
    assert documented == served


def test_every_metric_the_doc_names_exists(exposition: str) -> None:
    families = set(re.findall(r"^# TYPE (\w+) ", exposition, re.M))
    # A name ending in "_" is a prefix (DCGM_FI_PROF_*), not a metric.
    named = {n for n in re.findall(r"\b(gpu_agent_[a-z_]+|DCGM_FI_[A-Z_]+)", doc()) if not n.endswith("_")}
    known = families | {f + "_total" for f in families} | {f.name for f in FIELDS}
    assert named - known == set()


def test_the_alert_and_recording_tables_are_the_shipped_rules() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    rows = table_after("## Alert rules")
    assert [(row[0], row[1]) for row in rows] == [(r["alert"], r["labels"]["severity"]) for r in rules if "alert" in r]
    recorded = table_after("### Recording rules")
    assert [row[0] for row in recorded] == [r["record"] for r in rules if "record" in r]


def test_the_config_keys_the_doc_shows_are_the_agents() -> None:
    from agent.config import parse_config

    block = doc().split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_config(block)
    assert (config.telemetry.dcgm_metrics, config.telemetry.interval_seconds) == (True, 10)
