"""``gpusteward_findings_open`` survives a restart of the alerts process.

The gauge lived in memory and the consumer resumes from its committed offsets, so a
restarted process showed no open findings until new ones arrived. It is now rebuilt
from the whole findings topic before the consumer consumes, and the findings it leaves
open are handed to the Alertmanager sink, whose alerts had lapsed after a restart.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import msgspec
import pytest

from gpusteward import kafka, topics
from gpusteward.alerting.alertmanager import AlertmanagerSink
from gpusteward.alerting.consumer import FindingsConsumer
from gpusteward.schema import Finding, Subject
from gpusteward.settings import Settings
from tests.alerting.test_consumer_edge import consume_all, publish

pytestmark = pytest.mark.e2e

T0 = 1_763_683_200.0
Severity = Literal["info", "warning", "critical"]
State = Literal["firing", "resolved"]


def _finding(finding_id: str, kind: str, severity: Severity, state: State,
             ts: float) -> Finding:
    return Finding(id=finding_id, fingerprint=finding_id, kind=kind, severity=severity,
                   state=state, subject=Subject(node="n1"), summary="x", starts_at=T0, ts=ts)


def _open(consumer: FindingsConsumer) -> dict[tuple[str, str], float]:
    """The gauge's non-zero children: (kind, severity) -> open findings."""
    return {(sample.labels["kind"], sample.labels["severity"]): sample.value
            for family in consumer.metrics.registry.collect()
            if family.name == "gpusteward_findings_open"
            for sample in family.samples if sample.value}


def test_the_open_findings_gauge_is_rebuilt_after_a_restart(settings: Settings) -> None:
    asyncio.run(kafka.ensure_topics(settings))
    history = [
        _finding("a", "ecc_dbe", "critical", "firing", T0),
        _finding("b", "idle_holder", "warning", "firing", T0 + 1),
        _finding("c", "idle_holder", "warning", "firing", T0 + 2),
        _finding("a", "ecc_dbe", "critical", "resolved", T0 + 3),
    ]
    asyncio.run(publish(settings, [msgspec.json.encode(f) for f in history]))
    first = FindingsConsumer(settings, [])
    asyncio.run(consume_all(first))
    assert _open(first) == {("idle_holder", "warning"): 2}

    # Restarted: the group's offsets are past every record, and one more arrives.
    asyncio.run(publish(settings, [b"{not a finding", msgspec.json.encode(
        _finding("c", "idle_holder", "warning", "resolved", T0 + 4))]))
    delivered: list[Finding] = []
    # Nothing listens there: its posts fail and are kept for the next refresh.
    alertmanager = AlertmanagerSink("http://127.0.0.1:9")
    restarted = FindingsConsumer(settings, [alertmanager], on_finding=delivered.append)
    asyncio.run(consume_all(restarted))
    assert [(f.id, f.state) for f in delivered] == [("c", "resolved")]  # nothing re-announced
    assert _open(restarted) == {("idle_holder", "warning"): 1}
    # The alert still open before the restart is kept alive (re-posted every refresh), not
    # left to lapse at Alertmanager as if resolved; "c" was ended by its resolved record.
    assert list(alertmanager.firing) == ["b"]
    assert alertmanager.firing["b"]["labels"]["kind"] == "idle_holder"
    assert list(alertmanager.pending_resolved) == ["c"]
    records = asyncio.run(kafka.read_all(settings, topics.DEADLETTER.name(settings)))
    assert len(records) == 1  # the bad record dead-lettered once, by the consumer
