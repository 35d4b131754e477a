"""The report and the live rules judge the same queue and the same minute alike.

Both read the rule policy: the fleet agent's queue SLO rule
(:class:`~gpusteward.streams.fleet.FleetEvaluator`) and the idle-holder rule on
one side, the weekly report (:mod:`gpusteward.reports.policy`) on the other.
If either side grows its own table again, these tests fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusteward.reports import build, compute, store
from gpusteward.reports.settings import ReportSettings
from gpusteward.rules import idle
from gpusteward.rules.policy import Policy, parse_policy
from gpusteward.schema import QueueEvent
from gpusteward.streams.fleet import FleetEvaluator, FleetSettings

WEEK = compute.parse_week("2026-W47")
QUEUES = ["prod-training", "research-nlp", "batch", "team-a-dev"]
CUSTOM = """
rules:
  queue_wait_slo:
    slo_s: {'^team-a': 120.0, batch: 900.0}
    default_slo_s: 5400.0
  idle_holder:
    threshold_pct: 8.0
"""


def _admissions() -> list[QueueEvent]:
    return [QueueEvent(ts=WEEK.start + 3600 + i, name=f"w{i}", namespace="ns", cluster_queue=q,
                       state="admitted", created_at=WEEK.start + i,
                       admitted_at=WEEK.start + 3600 + i)
            for i, q in enumerate(QUEUES)]


@pytest.mark.parametrize("policy", [Policy(), parse_policy(CUSTOM)], ids=["defaults", "custom"])
def test_report_and_live_queue_rule_use_the_same_slo(policy: Policy, tmp_path: Path) -> None:
    live = FleetEvaluator(FleetSettings(policy=policy)).queue_settings
    queue = store.queue_frame(_admissions())
    report = build.build(tmp_path / "no-rollups", WEEK, ReportSettings(), queue=queue,
                         policy=policy)
    slos = {r["cluster_queue"]: r["slo_s"] for r in report.data["queues"]}
    assert set(slos) == set(QUEUES)
    assert slos == {q: live.slo_for(q) for q in QUEUES}
    # The defaults themselves: production 10 min, research 2 h, the rest 1 h.
    if not policy.rules:
        assert slos == {"prod-training": 600.0, "research-nlp": 7200.0, "batch": 3600.0,
                        "team-a-dev": 3600.0}
    else:
        # Patterns merge into the defaults (prod, research stay), the default is replaced.
        assert slos["team-a-dev"] == 120.0 and slos["batch"] == 900.0
        assert slos["prod-training"] == 600.0


def test_report_counts_idle_minutes_at_the_idle_rules_threshold(tmp_path: Path) -> None:
    policy = parse_policy(CUSTOM)
    live = policy.resolve(namespace="ns").of(idle.KIND, idle.IdleSettings).threshold_pct
    report = build.build(tmp_path / "none", WEEK, ReportSettings(), policy=policy)
    assert report.data["settings"]["idle_threshold_pct"] == live == 8.0
    # Without a policy file, the rule's own default; a report setting still wins when named.
    assert ReportSettings().idle_threshold_pct == idle.IdleSettings().threshold_pct
    named = build.build(tmp_path / "none", WEEK, ReportSettings(idle_threshold_pct=3.0),
                        policy=policy)
    assert named.data["settings"]["idle_threshold_pct"] == 3.0
