"""docker-compose.yml is valid Compose and wires the stack together.

Validated against the Compose Specification's JSON schema as vendored by the
PyPI package `check-jsonschema` (builtin_schemas/vendor/compose-spec.json,
copied from the compose-spec repository); its configuration files are checked
with promtool and amtool when the Debian packages are installed
(.ci/system-deps installs them).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.deploy

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    # Read as a data file: only the schema is needed, and check_jsonschema's
    # CLI module does not import with every click version typer allows.
    try:
        dist = distribution("check-jsonschema")
    except PackageNotFoundError:
        pytest.skip("check-jsonschema (dev extra) is not installed")
    path = Path(str(dist.locate_file("check_jsonschema/builtin_schemas/vendor/compose-spec.json")))
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return document


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    # The draft the schema declares (2020-12 today): an older draft's validator
    # would silently skip keywords such as unevaluatedProperties.
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_file_validates_against_the_compose_specification(compose_schema, compose):
    validator(compose_schema).validate(compose)


def test_schema_rejects_a_misspelt_service_key(compose_schema, compose):
    # A control: the schema must be strict enough to catch a typo.
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["comand"] = broken["services"]["worker"].pop("command")
    with pytest.raises(jsonschema.ValidationError):
        validator(compose_schema).validate(broken)


def test_kafka_is_the_official_image_in_kraft_mode_with_a_volume(compose):
    kafka = compose["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@")
    assert any(v.endswith(":" + env["KAFKA_LOG_DIRS"]) for v in kafka["volumes"])
    # The containers' bootstrap address is an advertised listener of the broker.
    bootstrap = compose["services"]["worker"]["environment"]["GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS"]
    advertised = {a.split("://", 1)[1] for a in env["KAFKA_ADVERTISED_LISTENERS"].split(",")}
    assert bootstrap in advertised


def test_services_and_profiles(compose):
    services = compose["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert {"kafka", "prometheus", "alertmanager", "worker", "alerts", "remediation"} <= default
    assert services["simulator"]["profiles"] == ["sim"]
    assert services["simulator"]["command"][:2] == ["simulate", "eight-a100"]
    for name in ("dcgm-exporter", "collector"):
        assert services[name]["profiles"] == ["gpu"]
        assert services[name]["runtime"] == "nvidia"
    assert services["collector"]["command"] == ["collect", "nvml"]
    assert services["worker"]["command"][0] == "worker"
    assert services["remediation"]["command"] == ["act", "--dry-run"]
    assert services["rollup-sink"]["command"] == ["sink", "rollups"]
    assert services["queue-sink"]["command"] == ["sink", "queue"]
    assert services["findings-sink"]["command"] == ["sink", "findings"]
    assert services["results-sink"]["command"] == ["sink", "results"]
    assert {"rollup-sink", "queue-sink", "findings-sink", "results-sink"} <= default
    assert services["report"]["profiles"] == ["report"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"


def test_prometheus_scrapes_every_pipeline_process(compose):
    """Every long-running gpusteward service (the worker, alerting, remediation and the
    sinks, whose rollup sink draws the fleet dashboard's GPU-seconds) is a target."""
    config = yaml.safe_load((REPO / "deploy/compose/prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "gpusteward"]
    targets = {t for c in job["static_configs"] for t in c["targets"]}
    serving = {name: service["environment"]["GPUSTEWARD_METRICS__PORT"]
               for name, service in compose["services"].items()
               if "GPUSTEWARD_METRICS__PORT" in service.get("environment", {})
               and not service.get("profiles")}
    assert {"worker", "alerts", "remediation", "rollup-sink", "results-sink"} <= set(serving)
    assert targets == {f"{name}:{port}" for name, port in serving.items()}


def test_gpusteward_containers_are_locked_down(compose):
    for name, service in compose["services"].items():
        if service.get("image") != "gpusteward:dev":
            continue
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert service["user"] == "10001:10001", name
        assert "no-new-privileges:true" in service["security_opt"], name


def test_bind_mounted_files_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (REPO / source).is_file(), f"{name} mounts missing {source}"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian package; see .ci/system-deps)")
    return path


def test_prometheus_config_is_valid():
    promtool = _tool("promtool")
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(REPO / "deploy/compose/prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_config_is_valid():
    amtool = _tool("amtool")
    result = subprocess.run(
        [amtool, "check-config", str(REPO / "deploy/compose/alertmanager.yml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_sinks_write_the_store_the_report_reads(compose):
    """The report service runs the CronJob's command on the volume the sinks write."""
    services = compose["services"]

    def store(name: str) -> tuple[str, dict[str, str]]:
        service = services[name]
        env = service["environment"]
        folders = {k: env[k] for k in ("GPUSTEWARD_REPORT__ROLLUP_DIR",
                                       "GPUSTEWARD_REPORT__QUEUE_DIR",
                                       "GPUSTEWARD_REPORT__FINDINGS_DIR",
                                       "GPUSTEWARD_REPORT__RESULTS_DIR")}
        (volume,) = [v.split(":")[0] for v in service["volumes"]
                     if all(f.startswith(v.split(":")[1] + "/") for f in folders.values())]
        assert volume in compose["volumes"], f"{name}: {volume} is not a named volume"
        return volume, folders

    assert store("rollup-sink") == store("queue-sink") == store("findings-sink") \
        == store("results-sink") == store("report")
    # The report reads the worker's policy (queue SLOs, idle threshold) where it points.
    for reader in ("report", "rollup-sink"):
        policy = services[reader]["environment"]["GPUSTEWARD_POLICY_FILE"]
        assert f"./deploy/base/policy.yaml:{policy}:ro" in services[reader]["volumes"]
    report = services["report"]
    command = " ".join(report["entrypoint"] + report["command"])
    assert "gpusteward report --week" in command
    # Compose would substitute a single $ itself, from the host's environment.
    assert "$$(date" in command
