"""The policy file: shipped defaults, layered overrides, located errors, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpusteward.cli import app
from gpusteward.rules import REGISTRY, fragmentation, hardware, idle, policy, queue
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


@pytest.mark.parametrize("rule", sorted(REGISTRY.configurable()))
def test_a_setting_no_rule_has_is_refused_with_its_file_line_and_field(rule: str) -> None:
    """A policy kept across an upgrade may name a setting the new release renamed or
    removed (team_budget's rate_window_s was): every rule refuses it, where it is. Seven of
    them took it silently, the rule running on its default instead."""
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy(f"rules:\n  {rule}:\n    rate_window_s: 3600\n", "old.yaml")
    assert caught.value.lines() == [
        f"old.yaml:3: rules.{rule}.rate_window_s: Extra inputs are not permitted"]


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


# -- values a rule only interprets at run time are refused at load ------------------------

RUN_TIME_VALUES = [
    # (policy, the one error it gives)
    ("rules:\n  fragmentation:\n    default_shapes:\n      two-gpus: 1.0\n",
     "bad.yaml:4: rules.fragmentation.default_shapes.two-gpus: bad shape 'two-gpus': "
     "expected '<gpus>x<milli>'"),
    ("rules:\n  fragmentation:\n    default_shapes: {'0x1000': 1}\n",
     "bad.yaml:3: rules.fragmentation.default_shapes.0x1000: bad shape '0x1000': expected "
     "at least 1 GPU and 1 to 1000 milli of each"),
    ("rules:\n  fragmentation:\n    default_shapes: {'1x2000': 1}\n",
     "bad.yaml:3: rules.fragmentation.default_shapes.1x2000: bad shape '1x2000': expected "
     "at least 1 GPU and 1 to 1000 milli of each"),
    ("rules:\n  fragmentation:\n    default_shapes:\n      '1x1000': 0\n",
     "bad.yaml:3: rules.fragmentation.default_shapes: needs a shape with a popularity above 0"),
    ("rules:\n  queue_wait_slo:\n    slo_s:\n      'prod[': 600\n",
     "bad.yaml:4: rules.queue_wait_slo.slo_s.prod[: not a regular expression: unterminated "
     "character set at position 4"),
    ("rules:\n  queue_wait_slo:\n    slo_s:\n      prod: -600\n",
     "bad.yaml:4: rules.queue_wait_slo.slo_s.prod: Input should be greater than 0"),
    ("rules:\n  idle_holder:\n    kinds:\n      notebooks: {window_s: 60}\n",
     "bad.yaml:4: rules.idle_holder.kinds.notebooks: unknown workload kind 'notebooks'; "
     "valid kinds: notebook, batch, inference"),
    ("namespaces:\n  ml:\n    gpu_memory_low_free:\n      workload_kinds: [inferense]\n",
     "bad.yaml:4: namespaces.ml.gpu_memory_low_free.workload_kinds.0: unknown workload kind "
     "'inferense'; valid kinds: notebook, batch, inference"),
    ("rules:\n  team_budget:\n    budgets_gpu_h:\n      ml: -5\n",
     "bad.yaml:4: rules.team_budget.budgets_gpu_h.ml: Input should be greater than or equal "
     "to 0"),
    ("rules:\n  team_budget:\n    thresholds:\n      - 0.8\n      - 0\n",
     "bad.yaml:5: rules.team_budget.thresholds.1: Input should be greater than 0"),
]


@pytest.mark.parametrize(("text", "error"), RUN_TIME_VALUES)
def test_values_rules_interpret_at_run_time_are_refused_at_load(text: str, error: str) -> None:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy(text, "bad.yaml")
    assert caught.value.lines() == [error]


def test_the_shipped_and_deployed_policies_and_valid_run_time_values_load() -> None:
    repo = Path(__file__).resolve().parents[2]
    for path in (repo / "rules" / "policy.yaml", repo / "deploy" / "base" / "policy.yaml"):
        resolved = policy_file.load_policy(path).resolve()
        frag = resolved.of(fragmentation.KIND, fragmentation.FragmentationSettings)
        assert fragmentation.shapes({}, frag) == {fragmentation.Shape(1, 1000): 1.0}
        slo = resolved.of(queue.WAIT_KIND, queue.QueueSloSettings)
        assert slo.slo_for("prod-east") == 600 and slo.slo_for("other") == 3600
    # What the checks accept, the rules can use: shapes parse, weights divide, patterns
    # search, the kinds are the ones pods are given.
    custom = policy.parse_policy(
        "rules:\n"
        "  fragmentation: {default_shapes: {'2x1000': 3, '1x500': 1}}\n"
        "  queue_wait_slo: {slo_s: {'^gold-[0-9]+$': 60}}\n"
        "  idle_holder: {kinds: {notebook: {window_s: 60}}}\n"
        "  gpu_memory_low_free: {workload_kinds: [inference, batch]}\n"
        "  team_budget: {budgets_gpu_h: {ml: 0}, thresholds: [0.5, 1.5]}\n").resolve()
    frag = custom.of(fragmentation.KIND, fragmentation.FragmentationSettings)
    assert fragmentation.shapes({}, frag) == {fragmentation.Shape(1, 1000): 0.2,
                                              fragmentation.Shape(2, 1000): 0.6,
                                              fragmentation.Shape(1, 500): 0.2}
    assert custom.of(queue.WAIT_KIND, queue.QueueSloSettings).slo_for("gold-7") == 60
    assert custom.of(IDLE, IdleSettings).effective("notebook").window_s == 60


def test_a_policy_s_own_entries_come_before_the_defaults_it_overrides() -> None:
    """A policy's maps are merged over the defaults: its SLO patterns must be tried before
    the default ones (first match wins), or `prod-gpu: 300` would never beat the default
    `prod: 600`; and a default request shape is left out with a popularity of 0."""
    resolved = policy.parse_policy(
        "rules:\n"
        "  queue_wait_slo: {slo_s: {prod-gpu: 300}}\n"
        "  fragmentation: {default_shapes: {'1x1000': 0, '8x1000': 1}}\n").resolve()
    slo = resolved.of(queue.WAIT_KIND, queue.QueueSloSettings)
    assert (slo.slo_for("prod-gpu-east"), slo.slo_for("prod-east"), slo.slo_for("other")) == (
        300, 600, 3600)
    frag = resolved.of(fragmentation.KIND, fragmentation.FragmentationSettings)
    assert fragmentation.shapes({}, frag) == {fragmentation.Shape(8, 1000): 1.0}


# -- the file itself: encoding, characters, duplicate keys ---------------------------------


def test_a_file_that_is_not_utf8_is_refused_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xff\xfe bad bytes\n")
    expected = f"{path}:1: <top>: not UTF-8 text: invalid start byte (byte 0xff)"
    with pytest.raises(policy.PolicyError) as caught:
        policy_file.load_policy(path)
    assert caught.value.lines() == [expected]
    runner = CliRunner()
    result = runner.invoke(app, ["rules", "check", str(path)])
    assert result.exit_code == 1 and expected in result.output
    result = runner.invoke(app, ["rules", "explain", "-p", str(path)])
    assert result.exit_code == 2 and expected in result.output


def test_a_character_yaml_does_not_allow_is_located() -> None:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy("rules:\n  idle_holder:\n    window_s: 5\x07\n", "bad.yaml")
    assert caught.value.lines() == [
        "bad.yaml:3: <top>: not valid YAML: special characters are not allowed "
        "(character #x0007)"]


def test_a_key_given_twice_is_refused_at_its_second_line() -> None:
    text = ("rules:\n"
            "  ecc_sbe_rate:\n"
            "    threshold: 50\n"
            "    threshold: 60\n"
            "  idle_holder: {window_s: 60}\n"
            "  idle_holder: {grace_s: 0}\n"
            "namespaces:\n"
            "  ml: {xid: {reclassify: {13: none, +13: reset_gpu}}}\n")
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy(text, "dup.yaml")
    assert caught.value.lines() == [
        "dup.yaml:4: rules.ecc_sbe_rate.threshold: duplicate key, first given on line 3",
        "dup.yaml:6: rules.idle_holder: duplicate key, first given on line 5",
        "dup.yaml:8: namespaces.ml.xid.reclassify.+13: duplicate key, first given on line 8",
    ]


def test_the_same_key_in_different_mappings_and_merge_keys_are_not_duplicates() -> None:
    text = ("rules:\n"
            "  idle_holder: &idle {window_s: 600, grace_s: 60}\n"
            "namespaces:\n"
            "  ml: {idle_holder: {<<: *idle, window_s: 900}}\n"
            "  ml-b: {idle_holder: *idle}\n")
    loaded = policy.parse_policy(text, "ok.yaml")
    assert loaded.resolve("ml").of(IDLE, IdleSettings).window_s == 900
    assert loaded.resolve("ml-b").of(IDLE, IdleSettings).grace_s == 60


def test_shape_errors_do_not_hide_the_rule_errors_elsewhere() -> None:
    text = ("namespaces:\n"
            "  ml-serving:\n"
            "    idle_holder:\n"
            "      window_s: soon\n"
            "    nope_rule: {}\n"
            "queues:\n"
            "  research: 5\n"
            "  batch: {idle_holder: {window_s: -1}}\n")
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy(text, "all.yaml")
    lines = caught.value.lines()
    assert [line.split(": ")[0:2] for line in lines] == [
        ["all.yaml:4", "namespaces.ml-serving.idle_holder.window_s"],
        ["all.yaml:5", "namespaces.ml-serving.nope_rule"],
        ["all.yaml:7", "queues.research"],
        ["all.yaml:8", "queues.batch.idle_holder.window_s"],
    ]
    assert lines[2] == "all.yaml:7: queues.research: Input should be a valid dictionary"
    # A file that is not a mapping at all has nothing else to check.
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy("- rules\n", "list.yaml")
    assert len(caught.value.lines()) == 1


def test_rules_list_and_explain_print_values_as_they_are() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["rules", "list"])
    assert result.exit_code == 0
    assert "  workload_kinds = [inference]: Workload kinds" in result.output
    result = runner.invoke(app, ["rules", "explain", "--output", "table", "--rule",
                                 "gpu_memory_low_free"])
    assert result.exit_code == 0 and "[inference]" in result.output
