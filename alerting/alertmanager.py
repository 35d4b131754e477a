"""Alertmanager sink: findings become Alertmanager v2 alerts.

Alertmanager identifies an alert by its label set, so a finding's labels are
built from what names the problem (kind, fingerprint, subject) and are kept
exactly as first sent: the resolved record of an episode carries severity
``info`` in the findings topic, and sending that would open a second alert
instead of ending the first. A resolved finding ends its alert by re-posting
the firing labels with ``endsAt`` set to the finding's end.

Firing alerts are posted with ``endsAt`` a few resend intervals ahead (as
Prometheus does), and :meth:`AlertmanagerSink.refresh` re-posts them before
that passes; if this process dies, its alerts resolve by themselves when
``endsAt`` passes instead of firing forever. A failed post is not lost: the
alert stays pending and the next refresh posts it again; after a failure the sink
makes no request for a quarter of the resend interval (15 s), so that an Alertmanager
that hangs costs one timeout per 15 s, not one per finding. When a resolved
finding arrives for an episode this process never saw fire (it restarted),
the sink asks Alertmanager for the active alerts with that fingerprint and
ends those. On start the consumer hands the sink the findings still open on the topic
(:meth:`AlertmanagerSink.restore`), which it keeps alive from its first refresh: without
them a restart let every open alert lapse at ``endsAt``, announced as resolved.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp

from gpusteward.errors import GpustewardError, shown_url, without_url
from gpusteward.rules.idle import owner_notice
from gpusteward.schema import Finding

log = logging.getLogger(__name__)


def rfc3339(ts: float) -> str:
    """Unix seconds as the RFC 3339 UTC timestamp Alertmanager expects."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def alert_labels(finding: Finding) -> dict[str, str]:
    """The identifying labels of a finding's alert."""
    labels = {
        "alertname": f"GpuSteward{''.join(p.title() for p in finding.kind.split('_'))}",
        "kind": finding.kind,
        "severity": finding.severity,
        "fingerprint": finding.fingerprint,
        "source": "gpusteward",
    }
    subject = finding.subject
    if subject.node:
        labels["node"] = subject.node
    if subject.device:
        labels["device"] = subject.device
    if subject.pod:
        labels["namespace"] = subject.pod.namespace
        labels["pod"] = subject.pod.name
    if subject.queue:
        labels["queue"] = subject.queue
    # A rule's own labels never override the identifying ones.
    return {**finding.labels, **labels}


def alert_annotations(finding: Finding) -> dict[str, str]:
    """The alert's annotations; an idle holder's ``description`` is its owner's notice, the
    words of the Kubernetes Event and the chat message (:func:`owner_notice`)."""
    annotations = {"summary": finding.summary, "finding_id": finding.id}
    if (notice := owner_notice(finding)) is not None:
        annotations["description"] = notice
    if finding.runbook:
        annotations["runbook"] = finding.runbook
    if finding.evidence and finding.evidence.values:
        annotations["evidence"] = ", ".join(
            f"{name}={value:g}" for name, value in sorted(finding.evidence.values.items()))
    return annotations


class AlertmanagerError(GpustewardError):
    """Alertmanager refused or could not be reached."""


class AlertmanagerSink:
    """Posts findings to an Alertmanager's ``/api/v2/alerts`` and keeps firing ones alive."""

    def __init__(self, url: str, *, resend_interval_s: float = 60.0,
                 lifetime_intervals: float = 4.0, generator_url: str = "",
                 timeout_s: float = 10.0, clock: Any = time.time) -> None:
        """``url`` is the Alertmanager base URL (``http://alertmanager:9093``).

        ``resend_interval_s``: how often firing alerts are re-posted, seconds;
        ``lifetime_intervals``: ``endsAt`` of a firing alert is this many
        intervals ahead, so a few lost posts do not resolve it (Prometheus
        uses 4); ``generator_url``: a link to where the finding can be seen
        (a dashboard); the fingerprint is appended as ``?fingerprint=``.
        """
        self.url = url.rstrip("/")
        self.shown = shown_url(self.url, keep_path=True)
        """The URL as messages show it: without ``user:password@`` or a query."""
        self.resend_interval_s = resend_interval_s
        self.lifetime_s = resend_interval_s * lifetime_intervals
        self.generator_url = generator_url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.clock = clock
        self.firing: dict[str, dict[str, Any]] = {}
        """Alerts kept alive, by finding fingerprint."""
        self.pending_resolved: dict[str, list[dict[str, Any]]] = {}
        """Resolved alerts not yet accepted by Alertmanager, by fingerprint."""
        self._last_post = 0.0
        self._retry_at = 0.0
        """After a failed request, no other is made before this (clock seconds): the
        findings meanwhile are kept and sent by the refresh after it."""
        self._session: aiohttp.ClientSession | None = None

    def _alert(self, finding: Finding) -> dict[str, Any]:
        """A firing finding's alert, without ``endsAt``."""
        return {"labels": alert_labels(finding), "annotations": alert_annotations(finding),
                "startsAt": rfc3339(finding.starts_at),
                "generatorURL": self._generator(finding)}

    def restore(self, findings: list[Finding]) -> None:
        """Keep alive the alerts of ``findings``, open before this process started (read
        back from the findings topic); the next :meth:`refresh` posts them, all at once."""
        for finding in findings:
            if finding.state == "firing":
                self.firing[finding.fingerprint] = self._alert(finding)

    async def deliver(self, finding: Finding) -> None:
        await self.deliver_many([finding])

    async def deliver_many(self, findings: list[Finding]) -> None:
        """Post the alerts of ``findings`` (a consumer batch, in record order) in one request.

        An episode that both fires and resolves in the batch is posted once, as resolved.
        A failed post loses nothing: firing alerts stay in :attr:`firing` and unsent
        resolutions in :attr:`pending_resolved`, and the next refresh posts them.
        """
        posting: dict[str, list[dict[str, Any]]] = {}
        for finding in findings:
            fingerprint = finding.fingerprint
            if finding.state == "firing":
                alert = self._alert(finding)
                self.firing[fingerprint] = alert
                self.pending_resolved.pop(fingerprint, None)
                posting[fingerprint] = [self._alive(alert)]
                continue
            ends_at = finding.ends_at if finding.ends_at is not None else finding.ts
            known = self.firing.pop(fingerprint, None)
            if known is not None:
                ended = [{**known, "endsAt": rfc3339(ends_at)}]
            else:
                ended = await self._active_alerts_for(finding, ends_at)
            self.pending_resolved[fingerprint] = ended
            posting[fingerprint] = ended
        alerts = [alert for group in posting.values() for alert in group]
        if not alerts:
            return
        if await self._post_quietly(alerts):
            for fingerprint in posting:
                self.pending_resolved.pop(fingerprint, None)

    async def refresh(self, force: bool = False) -> None:
        """Re-post firing alerts (and unsent resolutions) when a resend interval has passed;
        ``force``: now, a back-off after a failure included."""
        now = self.clock()
        if not force and now - self._last_post < self.resend_interval_s:
            return
        if force:
            self._retry_at = 0.0
        alerts = [self._alive(a) for a in self.firing.values()]
        for ended in self.pending_resolved.values():
            alerts.extend(ended)
        if not alerts:
            self._last_post = now
            return
        if await self._post_quietly(alerts):
            self.pending_resolved.clear()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _alive(self, alert: dict[str, Any]) -> dict[str, Any]:
        return {**alert, "endsAt": rfc3339(self.clock() + self.lifetime_s)}

    def _generator(self, finding: Finding) -> str:
        if not self.generator_url:
            return ""
        joiner = "&" if "?" in self.generator_url else "?"
        return f"{self.generator_url}{joiner}fingerprint={finding.fingerprint}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def post(self, alerts: list[dict[str, Any]]) -> None:
        """POST ``alerts``; raise :class:`AlertmanagerError` unless Alertmanager accepts them."""
        try:
            async with self._client().post(f"{self.url}/api/v2/alerts", json=alerts) as response:
                if response.status != 200:
                    body = (await response.text())[:300]
                    raise AlertmanagerError(f"Alertmanager answered {response.status}: {body}")
        except aiohttp.ClientError as error:
            raise AlertmanagerError(f"cannot reach Alertmanager at {self.shown}: "
                                    f"{without_url(str(error), self.url, keep_path=True)}"
                                    ) from error
        self._last_post = self.clock()

    def _backing_off(self) -> bool:
        return self.clock() < self._retry_at

    def _failed(self) -> None:
        # One request per retry interval while Alertmanager fails: a hung one costs the
        # consumer a timeout per request, and a burst of findings posted one by one behind
        # it held every sink (and the findings after) for hours.
        self._retry_at = self.clock() + self.resend_interval_s / 4

    async def _post_quietly(self, alerts: list[dict[str, Any]]) -> bool:
        """Post; on failure log and return False (the next refresh posts again). While
        backing off after a failure, return False without a request."""
        if not alerts:
            return True
        if self._backing_off():
            return False
        try:
            await self.post(alerts)
        except (AlertmanagerError, TimeoutError) as error:
            self._failed()
            log.warning("%s; %d alert(s) will be re-sent on the next refresh", error, len(alerts))
            return False
        return True

    async def _active_alerts_for(self, finding: Finding, ends_at: float) -> list[dict[str, Any]]:
        """Alertmanager's active alerts for ``finding``'s fingerprint, ended at ``ends_at``."""
        params = {"filter": f'fingerprint="{finding.fingerprint}"', "silenced": "true",
                  "inhibited": "true"}
        fallback = [{"labels": alert_labels(finding), "annotations": alert_annotations(finding),
                     "startsAt": rfc3339(finding.starts_at), "endsAt": rfc3339(ends_at),
                     "generatorURL": self._generator(finding)}]
        if self._backing_off():
            return fallback
        try:
            async with self._client().get(f"{self.url}/api/v2/alerts", params=params) as response:
                if response.status != 200:
                    raise AlertmanagerError(f"Alertmanager answered {response.status}")
                active = await response.json()
        except (aiohttp.ClientError, AlertmanagerError, TimeoutError) as error:
            self._failed()
            log.warning("cannot look up alerts to resolve %s: %s", finding.fingerprint,
                        without_url(str(error), self.url, keep_path=True))
            # Fall back to the finding's own labels: right unless severity changed.
            return fallback
        return [{"labels": a["labels"], "annotations": a.get("annotations", {}),
                 "startsAt": a["startsAt"], "endsAt": rfc3339(ends_at),
                 "generatorURL": a.get("generatorURL", "")}
                for a in active]

