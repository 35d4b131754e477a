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
    (["alerts"], "GPUSTEWARD_CLUSTER", "x" * 64, "63 at most"),
    (["report"], "GPUSTEWARD_CLUSTER", "prod-east" * 8, "63 at most"),
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
        "error: GPUSTEWARD_KAFKA__*: security_protocol SASL_SSL needs "
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


def _usage_error(result: subprocess.CompletedProcess[str], option: str, says: str) -> None:
    """Exit 2, click's usage error naming ``option``, and no traceback."""
    output = " ".join((result.stdout + result.stderr).split())  # the message box's wrapping
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert f"Invalid value for {option}" in output or f"Invalid value for '{option}'" in output
    assert says in output


@pytest.mark.parametrize(("argv", "option", "says"), [
    (["worker", "--loglevel", "loud"], "--loglevel", "'loud' is not a level: debug, info"),
    (["sink", "rollups", "--loglevel", "loud"], "--loglevel", "'loud' is not a level"),
    (["collect", "dcgm", "--loglevel", "loud"], "--loglevel", "'loud' is not a level"),
    (["watch", "--loglevel", "loud"], "--loglevel", "'loud' is not a level"),
    (["alerts", "--bootstrap", "127.0.0.1:abc"], "--bootstrap",
     "'127.0.0.1:abc' is not host:port"),
    (["status", "--bootstrap", "b1:9092,b2:99999"], "--bootstrap", "'b2:99999' is not host:port"),
    (["broker", "--port", "99999"], "--port", "less than or equal to 65535"),
    (["status", "--watch", "--interval", "-1"], "--interval", "-1 is not a positive number"),
    (["simulate", "--acceleration", "-5"], "--acceleration", "greater than or equal to 0"),
    (["act", "--backend", "kubernetes", "--kubeconfig", "absent"], "--kubeconfig",
     "cannot load the Kubernetes configuration from absent: "),
    (["act", "--backend", "kubernetes", "--kubeconfig", "absent", "--restore", "a/b/c"],
     "--kubeconfig", "cannot load the Kubernetes configuration from absent: "),
    (["report", "--rollups", ".", "--out", "a-file"], "--out", "a-file exists and is not a folder"),
    (["schema", "export", "a-file"], "directory", "a-file exists and is not a folder"),
    (["collect", "dcgm", "--buffer-dir", "a-file"], "--buffer-dir", "a-file exists and is not"),
    (["sink", "rollups", "--dir", "a-file"], "--dir", "a-file exists and is not a folder"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(tmp_path, argv, option, says):
    (tmp_path / "a-file").write_text("kept\n")
    result = gpusteward(tmp_path, *argv, COLUMNS="200", TERM="dumb")
    _usage_error(result, option, says)
    assert (tmp_path / "a-file").read_text() == "kept\n"


def test_a_bad_bootstrap_variable_is_named_with_its_flag(tmp_path):
    result = gpusteward(tmp_path, "alerts", COLUMNS="200", TERM="dumb",
                        GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS="127.0.0.1:abc")
    _usage_error(result, "--bootstrap", "(env var: 'GPUSTEWARD_KAFKA__BOOTSTRAP_SERVERS'): "
                 "'127.0.0.1:abc' is not host:port")


@pytest.mark.parametrize(("argv", "env", "line"), [
    (["doctor", "--skip", "kafka", "--skip", "kube"], {"GPUSTEWARD_KAFKA": "{bad json"},
     "error: GPUSTEWARD_KAFKA='{bad json': must be JSON (a list or an object): "),
    (["act"], {"GPUSTEWARD_REMEDIATION__ENABLED_RULES": "idle"},
     "error: GPUSTEWARD_REMEDIATION__ENABLED_RULES='idle': must be JSON (a list or an object): "),
    (["alerts"], {"GPUSTEWARD_KAFKA": '{"node_partitions": "x"}'},
     "error: GPUSTEWARD_KAFKA (key 'node_partitions'): Input should be a valid integer"),
    (["doctor", "--skip", "kube", "--skip", "policy"],
     {"GPUSTEWARD_KAFKA": '{"bootstrap_servers": "h:abc"}'},
     "error: GPUSTEWARD_KAFKA (key 'bootstrap_servers'): 'h:abc' is not host:port"),
    (["alerts"], {"GPUSTEWARD_KAFKA__SECURITY_PROTOCOL": "SSL",
                  "GPUSTEWARD_KAFKA__SSL_CAFILE": "/nonexistent.pem"},
     "error: GPUSTEWARD_KAFKA__SSL_CAFILE=/nonexistent.pem: no such file"),
    (["report", "--rollups", "."], {"GPUSTEWARD_REPORT__ARCHIVE_DIR": "a-file"},
     "error: GPUSTEWARD_REPORT__ARCHIVE_DIR='a-file': a-file exists and is not "
     "a folder"),
    (["collect", "dcgm"], {"GPUSTEWARD_COLLECT__BUFFER_DIR": "a-file"},
     "error: GPUSTEWARD_COLLECT__BUFFER_DIR='a-file': a-file exists and is not "
     "a folder"),
])
def test_a_bad_variable_is_one_line_naming_it(tmp_path, argv, env, line):
    (tmp_path / "a-file").write_text("kept\n")
    result = gpusteward(tmp_path, *argv, **env)
    assert result.returncode == 2, result.stderr
    (only,) = result.stderr.splitlines()
    assert only.startswith(line)
    assert not (tmp_path / "report").exists()


def test_the_worker_reads_its_policy_before_waiting_for_the_broker(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  idle:\n    no_such_field: 1\n")
    started = time.monotonic()
    result = gpusteward(tmp_path, "worker", "--bootstrap", f"127.0.0.1:{free_port()}",
                        GPUSTEWARD_POLICY_FILE=str(policy))
    assert result.returncode == 2
    assert time.monotonic() - started < 20  # not the broker's 30 s wait first
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {policy}:")


def test_status_without_a_broker_says_where_it_looked(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"
    result = gpusteward(tmp_path, "status", "--bootstrap", bootstrap, "--json")
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: Kafka at {bootstrap} did not answer within 10")
