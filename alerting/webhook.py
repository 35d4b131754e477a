"""Generic webhook sink: one Slack-compatible JSON message per finding.

The body is what a Slack incoming webhook accepts (``text`` plus one
coloured ``attachments`` entry with fields), which Mattermost, Rocket.Chat,
Discord's ``/slack`` endpoint and most chat bridges accept too. The whole
finding rides along under ``gpusteward`` for receivers that want the data
rather than the words (Slack ignores unknown fields).

A failed post is retried with backoff a few times; after that the message
is kept and re-sent on the next :meth:`WebhookSink.refresh`, so a chat
outage delays notifications but does not lose them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec

from gpusteward.errors import shown_url, without_url
from gpusteward.rules.idle import owner_notice
from gpusteward.schema import Finding

log = logging.getLogger(__name__)

COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
RESOLVED_COLOUR = "#2ca02c"


def slack_message(finding: Finding) -> dict[str, Any]:
    """The Slack-compatible body for ``finding``.

    An idle holder's message says what its owner's Event says (:func:`owner_notice`): what
    was seen, what happens next and how to keep the GPU, not only the finding's summary."""
    firing = finding.state == "firing"
    head = f"FIRING {finding.severity}" if firing else "RESOLVED"
    text = f"[{head}] {finding.kind}: {owner_notice(finding) or finding.summary}"
    fields = [{"title": "kind", "value": finding.kind, "short": True},
              {"title": "state", "value": finding.state, "short": True}]
    subject = finding.subject
    if subject.node:
        fields.append({"title": "node", "value": subject.node, "short": True})
    if subject.device:
        fields.append({"title": "device", "value": subject.device, "short": True})
    if subject.pod:
        fields.append({"title": "pod", "value": f"{subject.pod.namespace}/{subject.pod.name}",
                       "short": True})
    if firing and finding.runbook:
        fields.append({"title": "runbook", "value": finding.runbook, "short": False})
    return {
        "text": text,
        "attachments": [{
            "color": COLOURS[finding.severity] if firing else RESOLVED_COLOUR,
            "fallback": text,
            "fields": fields,
            "ts": int(finding.ts),
        }],
        "gpusteward": msgspec.to_builtins(finding),
    }


class WebhookSink:
    """POSTs each finding to ``url`` as Slack-compatible JSON."""

    def __init__(self, url: str, *, attempts: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 10.0, min_severity: str = "info") -> None:
        """``min_severity``: findings below it (info < warning < critical) are not sent."""
        self.url = url
        self.shown = shown_url(url)
        """Where log lines say the messages go: the path and query are the credential."""
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.min_rank = _RANK[min_severity]
        self.unsent: list[dict[str, Any]] = []
        self._session: aiohttp.ClientSession | None = None

    async def deliver(self, finding: Finding) -> None:
        # A resolution is sent whatever its severity: its firing record passed the filter.
        if finding.state == "firing" and _RANK[finding.severity] < self.min_rank:
            return
        message = slack_message(finding)
        if not await self._send(message):
            self.unsent.append(message)

    async def refresh(self, force: bool = False) -> None:
        """Try the messages that could not be sent earlier, oldest first."""
        while self.unsent:
            if not await self._send(self.unsent[0], attempts=1):
                return
            self.unsent.pop(0)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(self, message: dict[str, Any], attempts: int | None = None) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        tries = attempts or self.attempts
        for attempt in range(tries):
            try:
                async with self._session.post(self.url, json=message) as response:
                    if response.status < 300:
                        return True
                    problem = f"answered {response.status}: {(await response.text())[:200]}"
                    if 400 <= response.status < 500 and response.status != 429:
                        log.error("webhook %s rejected a message (%s); dropping it",
                                  self.shown, problem)
                        return True
            except aiohttp.InvalidURL:
                problem = "not an http(s) URL"
            except (aiohttp.ClientError, TimeoutError) as error:
                problem = without_url(str(error), self.url) or type(error).__name__
            if attempt + 1 < tries:
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        log.warning("webhook %s: %s; the message is kept for the next refresh", self.shown,
                    problem)
        return False


_RANK = {"info": 0, "warning": 1, "critical": 2}
