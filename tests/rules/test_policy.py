"""The policy file: shipped defaults, layered overrides, located errors, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.rules import REGISTRY, hardware, idle, policy
from gpusteward.rules.idle import IdleSettings
from gpusteward.streams import policy_file

IDLE = idle.KIND

SHIPPED = Path(policy.__file__).with_name("policy.yaml")

LAYERED = """\
node_pool_label: cloud.google.com/gke-nodepool
rules:
  idle_holder:
    window_s: 3600
    kinds:
      batch: {window_s: 900}
node_pools:
  h100-spot:
    idle_holder: {window_s: 1200, grace_s: 60}
    thermal_slowdown: {slowdown_c: {H100: 80}}
queues:
  research:
    idle_holder: {window_s: 600}
namespaces:
  ml-serving:
    idle_holder: {window_s: 7200}
"""

BROKEN = """\
rules:
  idle_holder:
    window_s: -5
    windw_s: 10
  thermal_slowdown:
    slowdown_c: {H100: hot}
  no_such_rule: {}
namespaces:
  ml-a:
    xid:
      classes:
        reset_gpu: {min_count: 0}
"""


def test_shipped_policy_is_generated_from_the_models_and_holds_their_defaults() -> None:
    shipped = policy.parse_policy(SHIPPED.read_text(), "policy.yaml")
    assert SHIPPED.read_text() == policy.render_defaults()
    assert set(shipped.rules) == set(REGISTRY.configurable())
    for name, model in REGISTRY.configurable().items():
        assert shipped.resolve().rules[name] == model()
    # With no file, the worker runs on the same settings without reading one.
    assert policy_file.load_policy(None).resolve().rules == shipped.resolve().rules


def test_layers_apply_pool_then_queue_then_namespace() -> None:
    p = policy.parse_policy(LAYERED, "layered.yaml")
    assert p.node_pool_label == "cloud.google.com/gke-nodepool"
    assert p.resolve().of(IDLE, IdleSettings).window_s == 3600
    assert p.resolve(node_pool="h100-spot").of(IDLE, IdleSettings).window_s == 1200
    assert p.resolve(queue="research", node_pool="h100-spot").of(IDLE, IdleSettings).window_s \
        == 600
    both = p.resolve("ml-serving", "research", "h100-spot").of(IDLE, IdleSettings)
    assert both.window_s == 7200 and both.grace_s == 60
    # Nested mappings merge key by key: the batch override keeps the other kinds' defaults.
    assert p.resolve().of(IDLE, IdleSettings).kinds["batch"].window_s == 900
    assert p.resolve().of(IDLE, IdleSettings).kinds["inference"] == \
        IdleSettings().kinds["inference"]
    thermal = p.resolve(node_pool="h100-spot").of(hardware.THERMAL_KIND,
                                                  hardware.ThermalSettings)
    assert thermal.threshold_for("NVIDIA H100 80GB HBM3") == 80
    assert thermal.threshold_for("NVIDIA A100-SXM4-80GB") == 89


def test_resolution_is_cached() -> None:
    p = policy.parse_policy(LAYERED)
    assert p.resolve("a", "b", "c") is p.resolve("a", "b", "c")


def test_errors_name_file_line_and_field() -> None:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy(BROKEN, "broken.yaml")
    lines = caught.value.lines()
    assert "broken.yaml:3: rules.idle_holder.window_s: Input should be greater than 0" in lines
    assert "broken.yaml:4: rules.idle_holder.windw_s: Extra inputs are not permitted" in lines
    assert any(line.startswith("broken.yaml:6: rules.thermal_slowdown.slowdown_c.H100: ")
               for line in lines)
    assert any(line.startswith("broken.yaml:7: rules.no_such_rule: unknown rule; valid rules: ")
               for line in lines)
    assert any(line.startswith(
        "broken.yaml:12: namespaces.ml-a.xid.classes.reset_gpu.min_count: ") for line in lines)
    assert len(lines) == 5


def test_yaml_syntax_and_shape_errors_are_located() -> None:
    with pytest.raises(policy.PolicyError, match=r"^bad.yaml:3: <top>: not valid YAML"):
        policy.parse_policy("rules:\n  idle_holder: {window_s: 1\n  x: [\n", "bad.yaml")
    with pytest.raises(policy.PolicyError, match=r"^bad.yaml:2: namespacs: Extra inputs"):
        policy.parse_policy("rules: {}\nnamespacs: {}\n", "bad.yaml")


def test_env_names_the_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(LAYERED)
    assert policy_file.policy_from_env({"GPUSTEWARD_POLICY_FILE": str(path)}
                                       ).node_pool_label == "cloud.google.com/gke-nodepool"
    assert policy_file.policy_from_env({}).node_pool_label == policy.DEFAULT_POOL_LABEL
    with pytest.raises(policy.PolicyError, match="cannot read"):
        policy_file.load_policy(tmp_path / "missing.yaml")


def test_cli_check_and_explain(tmp_path: Path) -> None:
    runner = CliRunner()
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(LAYERED)
    bad.write_text(BROKEN)
    result = runner.invoke(app, ["rules", "check", str(good)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "1 node pool(s), 1 queue(s), 1 namespace(s)" in result.output
    result = runner.invoke(app, ["rules", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:3: rules.idle_holder.window_s: Input should be greater than 0" in result.output
    result = runner.invoke(app, ["rules", "explain", "--policy", str(good), "--namespace",
                                 "ml-serving", "--node-pool", "h100-spot", "--rule",
                                 "idle_holder"])
    assert result.exit_code == 0, result.output
    assert "window_s: 7200.0" in result.output and "grace_s: 60.0" in result.output
    result = runner.invoke(app, ["rules", "explain", "--output", "table"])
    assert result.exit_code == 0 and "thermal_slowdown" in result.output
    result = runner.invoke(app, ["rules", "list"])
    assert result.exit_code == 0 and "rma_count" in result.output
