"""The rule registry: every emitted kind has an owner, and names are checked against it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import gpusteward.rules
from gpusteward.cli import app
from gpusteward.remediation import executor
from gpusteward.rules import REGISTRY, UnknownRuleError, policy, xid
from gpusteward.rules.registry import Registry


def _kind_constants() -> set[str]:
    """Every ``*KIND`` string constant of the rule modules and the remediation executor."""
    modules = [importlib.import_module(info.name) for info in
               pkgutil.walk_packages(gpusteward.rules.__path__, "gpusteward.rules.")]
    kinds: set[str] = set()
    for module in [*modules, executor]:
        kinds.update(value for name, value in vars(module).items()
                     if name.endswith("KIND") and isinstance(value, str))
    return kinds


def test_every_kind_the_pipeline_emits_has_a_rule() -> None:
    kinds = _kind_constants()
    assert {"xid_rma", "stranded_capacity", "queue_projected_breach", "mig_layout_advice",
            "remediation_breaker"} <= kinds
    assert kinds == set(REGISTRY.kinds)


def test_rules_list_names_every_kind() -> None:
    result = CliRunner().invoke(app, ["rules", "list"])
    assert result.exit_code == 0, result.output
    for kind, rule in REGISTRY.kinds.items():
        assert kind in result.output
        assert f"emits: {', '.join(rule.emits)}" in result.output
    assert "remediation_breaker (fleet, run by remediation)" in result.output


def test_a_rule_name_enables_every_kind_it_emits() -> None:
    assert REGISTRY.enabled_kinds(["xid"]) == {"xid", xid.RMA_KIND}
    assert REGISTRY.enabled_kinds(["xid_rma"]) == {"xid_rma"}
    assert REGISTRY.enabled_kinds(["*"]) == {"*"}
    assert executor.RemediationSettings(enabled_rules={"xid"}).enables("xid_rma")
    assert not executor.RemediationSettings(enabled_rules={"xid_rma"}).enables("xid")
    assert executor.RemediationSettings(enabled_rules={"*"}).enables("anything")


def test_an_unknown_name_lists_the_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnknownRuleError) as caught:
        REGISTRY.enabled_kinds(["ecc_dbe", "xdi"])
    message = str(caught.value)
    assert message.startswith("unknown rule or finding kind 'xdi'; valid: ")
    assert "xid_rma" in message and "idle_holder" in message
    with pytest.raises(ValidationError, match="unknown rule or finding kind 'xdi'"):
        executor.RemediationSettings(enabled_rules={"xdi"})
    monkeypatch.setenv("GPUSTEWARD_REMEDIATION__ENABLED_RULES", '["idle"]')
    with pytest.raises(ValidationError, match="unknown rule or finding kind 'idle'"):
        executor.RemediationSettings()


def test_act_refuses_an_unknown_enable_rule() -> None:
    result = CliRunner().invoke(app, ["act", "--execute", "--enable-rule", "ecc_dbe",
                                      "--enable-rule", "xdi"])
    assert result.exit_code == 2
    assert "--enable-rule" in result.output and "unknown rule or finding kind 'xdi'" in \
        result.output


def test_policy_sections_are_rule_names_not_kinds() -> None:
    with pytest.raises(policy.PolicyError) as caught:
        policy.parse_policy("rules:\n  xid_rma: {}\nnamespaces:\n  ml:\n"
                            "    remediation_breaker: {}\n", "p.yaml")
    assert caught.value.lines() == [
        "p.yaml:2: rules.xid_rma: a finding kind of rule xid; configure it under xid",
        "p.yaml:5: namespaces.ml.remediation_breaker: not configured by the policy: "
        f"{REGISTRY['remediation_breaker'].describe()}",
    ]


def test_registry_refuses_a_name_or_kind_taken() -> None:
    registry = Registry([REGISTRY["xid"]])
    with pytest.raises(ValueError, match="already registered: xid_rma"):
        registry.register(gpusteward.rules.Rule("other", None, "fleet", kinds=("xid_rma",)))
    with pytest.raises(UnknownRuleError, match="valid: xid"):
        registry["ecc_dbe"]


def test_the_policy_module_does_no_io() -> None:
    source = inspect.getsource(policy)
    for needle in ("import os", "open(", "read_text", "environ", "importlib"):
        assert needle not in source, needle
