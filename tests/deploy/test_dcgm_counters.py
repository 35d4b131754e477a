"""The dcgm-exporter counters file deploy/ ships switches on what the rules read.

Stock dcgm-exporter leaves the ECC, NVLink-error, row-remap-pending and
clock-event counters off (/work/shared/data/dcgm_default_counters.csv, from
its etc/default-counters.csv), so the hardware rules would see nothing on the
dcgm and Prometheus paths. The file is held to the metric names
collectors/dcgm.py reads, in the format dcgm-exporter parses, and to the
stock set it extends; the component renders it as the ConfigMap the GPU
Operator's values snippet names.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from gpusteward.collectors import dcgm
from tests.deploy.conftest import DEPLOY

pytestmark = pytest.mark.deploy

COMPONENT = DEPLOY / "components" / "dcgm-exporter"
COUNTERS = COMPONENT / "dcgm-metrics.csv"
VALUES = COMPONENT / "gpu-operator-values.yaml"
PROM_TYPES = {"gauge", "counter", "label"}
DEPRECATED_ALIASES = {"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"}
"""Old names of a field the file enables under its current name (CLOCKS_EVENT_REASONS)."""


def rows(text: str) -> list[list[str]]:
    """The active lines, as dcgm-exporter reads them: '#' comments and blanks skipped."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [[cell.strip() for cell in row] for row in csv.reader(lines)]


def enabled(text: str) -> set[str]:
    return {row[0] for row in rows(text)}


def test_counters_file_is_in_dcgm_exporters_format() -> None:
    seen: set[str] = set()
    for row in rows(COUNTERS.read_text()):
        assert len(row) == 3, row
        field, prom_type, help_text = row
        assert field.startswith(("DCGM_FI_", "DCGM_EXP_")), field
        assert prom_type in PROM_TYPES, row
        assert help_text, row
        assert field not in seen, f"{field} twice"
        seen.add(field)


def test_every_field_the_collector_reads_is_switched_on() -> None:
    fields = enabled(COUNTERS.read_text())
    assert set(dcgm.MAPPED_METRICS) - DEPRECATED_ALIASES <= fields
    for family in dcgm.FIELD_FAMILIES:
        assert fields & set(family.metrics), family.name


def test_it_extends_the_stock_set_and_adds_what_the_stock_set_lacks(shared_data: Path) -> None:
    stock_rows = [row for row in rows((shared_data / "dcgm_default_counters.csv").read_text())
                  if row[0] != "dcgm_field"]
    stock = {row[0] for row in stock_rows if row[3] == "true"}
    ours = enabled(COUNTERS.read_text())
    assert stock <= ours, "dropping a stock counter would break dashboards built on it"
    added = {f.name for f in dcgm.FIELD_FAMILIES if stock.isdisjoint(f.metrics)}
    assert added == {"clock_event_reasons", "ecc_sbe", "ecc_dbe", "row_remap_pending",
                     "nvlink_errors", "nvlink_crc_errors"}


def test_the_component_renders_the_configmap_the_gpu_operator_values_name(render) -> None:
    rendered = render("production+dcgm+execute")
    values = yaml.safe_load(VALUES.read_text())["dcgmExporter"]
    config_map = rendered.named("ConfigMap", values["config"]["name"])
    assert config_map["metadata"]["namespace"] == "gpu-operator"
    (collectors,) = [e["value"] for e in values["env"] if e["name"] == "DCGM_EXPORTER_COLLECTORS"]
    # The operator mounts the ConfigMap's keys under /etc/dcgm-exporter/.
    assert collectors == f"/etc/dcgm-exporter/{COUNTERS.name}"
    assert config_map["data"][COUNTERS.name] == COUNTERS.read_text()
    # Only the dcgm variant ships it.
    assert not [c for c in render("production").kind("ConfigMap")
                if c["metadata"]["name"] == values["config"]["name"]]


def test_docker_compose_dcgm_exporter_reads_the_same_file() -> None:
    compose = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())
    exporter = compose["services"]["dcgm-exporter"]
    path = exporter["environment"]["DCGM_EXPORTER_COLLECTORS"]
    sources = [v.split(":")[0] for v in exporter["volumes"] if v.split(":")[1] == path]
    assert [(DEPLOY.parent / s).resolve() for s in sources] == [COUNTERS]
