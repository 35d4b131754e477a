"""The ``gpusteward`` entry point: a bad setting stops a process with one line naming it.

A pod in CrashLoopBackOff shows the tail of its log; a 45-line traceback that ends in
``kafka.fetch_max_wait_ms`` makes the user map a field back to a variable, and a
group's check (SASL) printed the Kafka password with the rest of its input.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from pydantic import BaseModel, ValidationError

from gpusteward.broker import free_port
from gpusteward.cli.common import settings_errors
from gpusteward.health import LIVE_PATH, probe
from gpusteward.settings import Settings


def gpusteward(tmp_path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real entry point, as a container runs it, with only ``env``'s settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUSTEWARD_")}
    return subprocess.run([sys.executable, "-P", "-m", "gpusteward.cli", *argv],
                          env={**clean, **env}, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("argv", "variable", "value", "says"), [
    (["alerts"], "GPUSTEWARD_KAFKA__FETCH_MAX_WAIT_MS", "abc", "valid integer"),
    (["worker"], "GPUSTEWARD_HEALTH_PORT", "x", "valid integer"),
    (["collect", "dcgm"], "GPUSTEWARD_COLLECT__INTERVAL_S", "0", "greater than 0"),
    (["sink", "rollups"], "GPUSTEWARD_REPORT__RETENTION_DAYS", "abc", "valid integer"),
    (["watch"], "GPUSTEWARD_KUBE__RESYNC_PERIOD_S", "soon", "valid number"),
])
def test_an_invalid_value_ends_the_process_with_one_line_naming_the_variable(
        tmp_path, argv, variable, value, says):
    result = gpusteward(tmp_path, *argv, **{variable: value})
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {variable}={value!r}: ") and says in line


def test_a_bad_policy_file_is_one_line_too(tmp_path):
    result = gpusteward(tmp_path, "sink", "rollups",
                        GPUSTEWARD_POLICY_FILE=str(tmp_path / "absent.yaml"))
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 'absent.yaml'}:") and "cannot read" in line


SCENARIO_MISTAKES = {
    "missing.yaml": None,
    "syntax.yaml": "name: x\nusers: [a\n",
    "empty.yaml": "",
    "unknown.yaml": "name: x\nduration_s: 60\nnodes: [{prefix: a, count: 1}]\nusers: [a]\n"
                    "seeds: 3\n",
    "wrong.yaml": "name: x\nduration_s: soon\nnodes: [{prefix: a, count: 1}]\nusers: [a]\n",
}
"""Each file's mistake, and the first line of the error the user must see for it."""
SCENARIO_SAYS = {
    "missing.yaml": "missing.yaml:?: <top>: cannot read: ",
    "syntax.yaml": "syntax.yaml:3: <top>: not valid YAML: ",
    "empty.yaml": "empty.yaml:1: <top>: empty: a scenario needs at least name, duration_s,",
    "unknown.yaml": "unknown.yaml:5: seeds: Extra inputs are not permitted",
    "wrong.yaml": "wrong.yaml:2: duration_s: Input should be a valid number",
}


@pytest.mark.parametrize(("argv", "name"), [
    *((["simulate"], name) for name in SCENARIO_MISTAKES),
    (["demo", "--no-live", "--scenario"], "syntax.yaml"),
    (["collect", "nvml", "--fake-nvml"], "missing.yaml"),
    (["collect", "nvml", "--fake-nvml"], "syntax.yaml"),
])
def test_a_bad_scenario_file_is_file_line_field_without_a_traceback(tmp_path, argv, name):
    text = SCENARIO_MISTAKES[name]
    if text is not None:
        (tmp_path / name).write_text(text)
    result = gpusteward(tmp_path, *argv, name)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {SCENARIO_SAYS[name]}")


def test_a_group_check_names_the_group_and_never_prints_the_password(tmp_path):
    result = gpusteward(tmp_path, "alerts", GPUSTEWARD_KAFKA__SECURITY_PROTOCOL="SASL_SSL",
                        GPUSTEWARD_KAFKA__SASL_PASSWORD="s3cret-password")
    assert result.returncode == 2
    assert "s3cret-password" not in result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: GPUSTEWARD_KAFKA__*: Value error, security_protocol SASL_SSL needs "
        "kafka.sasl_mechanism, kafka.sasl_username"]


def test_a_value_from_a_flag_is_named_by_its_field(tmp_path):
    result = gpusteward(tmp_path, "collect", "dcgm", "--interval", "0")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: CollectSettings.interval_s: Input should be greater than 0"]


def test_only_settings_errors_are_turned_into_lines():
    # Any other model's error is a bug: main() re-raises it with its traceback.
    class Payload(BaseModel):
        count: int

    with pytest.raises(ValidationError) as payload:
        Payload(count="many")
    assert settings_errors(payload.value, {}) is None
    with pytest.raises(ValidationError) as setting:
        Settings(health_port="x")
    assert settings_errors(setting.value, {}) == [
        "Settings.health_port: Input should be a valid integer, unable to parse string as an "
        "integer"]
    assert settings_errors(setting.value, {"gpusteward_health_port": "x"}) == [
        "gpusteward_health_port='x': Input should be a valid integer, unable to parse string "
        "as an integer"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_broker_is_awaited_ends_the_consumer_at_once(tmp_path, signum):
    """SIGTERM (a pod stopped) or Ctrl-C before the broker answers: the consumer does not
    sit out its 30 s wait for the broker."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUSTEWARD_")}
    health = free_port()
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "gpusteward.cli", "alerts"],
        env={**clean, "GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
             "GPUSTEWARD_HEALTH_PORT": str(health)},
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while probe(health, LIVE_PATH) is None:  # started, and waiting for the broker
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        asked = time.monotonic()
        process.send_signal(signum)
        assert process.wait(10) == 0
        assert time.monotonic() - asked < 5
    finally:
        if process.poll() is None:
            process.kill()
