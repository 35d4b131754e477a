"""Generic webhook sink: Slack-compatible JSON messages, paced as Slack allows.

The body is what a Slack incoming webhook accepts (``text`` plus one
coloured ``attachments`` entry with fields), which Mattermost, Rocket.Chat,
Discord's ``/slack`` endpoint and most chat bridges accept too. The whole
finding rides along under ``gpusteward`` for receivers that want the data
rather than the words (Slack ignores unknown fields).

A chat channel is read by people, so the sink is shaped by what they can read and by
what Slack allows (about one message per second per webhook, then 429 with
``Retry-After``):

- the findings of one kind, state and severity on one node's devices in a consumer batch
  are one message (a node whose eight GPUs report a double-bit error at once is one
  message, not eight); a pod's finding is a message of its own, its owner's text;
- at most :data:`DIGEST_OVER` messages per :data:`DIGEST_EVERY_S`; past that (a fleet-wide
  incident, or one that trickles in node by node as a bad driver rolls out), the findings
  are gathered and posted as one digest, counts by kind and a line per finding up to the
  text limit, at most one digest per :data:`DIGEST_EVERY_S` while they keep coming
  (before, only a single consumer batch of more than ten was a digest: a rollout that
  broke a node's eight GPUs every minute posted eight messages a minute for as long as it
  ran);
- messages are sent at most one per :data:`MIN_INTERVAL_S`, and a 429's ``Retry-After``
  is waited out before the next request (up to :data:`MAX_RETRY_AFTER_S`; a longer one
  keeps the message for later without holding the consumer);
- ``&``, ``<`` and ``>`` are escaped as Slack's formatting asks: ``<...>`` is a link or
  a mention to Slack, and the owner's ``keep-until=<RFC 3339 time>`` vanished from it.

A failed post is retried with backoff a few times; after that the message
is kept and re-sent on the next :meth:`WebhookSink.refresh`, and while messages are kept
new ones queue behind them (in order, and an unreachable receiver costs one timeout, not
one per finding), so a chat outage delays notifications but does not lose them. Kept
messages live in memory, so the sink says which findings they carry (:meth:`holding`):
the consumer commits no further than the oldest of those, and a restarted process reads
them again and sends them then. A receiver that refuses a message for good (4xx other than 429: 404
or 410 is a revoked or mistyped webhook) drops it, said once per status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from gpusteward.alerting.consumer import News, news
from gpusteward.errors import retry_after, shown_url, without_url
from gpusteward.rules.idle import owner_notice
from gpusteward.schema import Finding

log = logging.getLogger(__name__)

COLOURS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
RESOLVED_COLOUR = "#2ca02c"

DIGEST_OVER = 10
"""Most messages per :data:`DIGEST_EVERY_S` (one per finding, or per node's findings of one
kind); the findings past it are gathered into one digest message: a channel reads ten
messages, not a thousand (and Slack takes about one a second)."""
DIGEST_EVERY_S = 60.0
"""Least seconds between two digests, and the window of :data:`DIGEST_OVER`: while findings
keep coming past the budget, the channel gets one digest a minute, whatever their rate."""
TEXT_LIMIT = 40_000
"""Slack truncates a message's ``text`` beyond 40,000 characters; a digest stops before."""
MIN_INTERVAL_S = 1.0
"""Least seconds between two posts to one webhook: Slack's rate for incoming webhooks."""
MAX_RETRY_AFTER_S = 30.0
"""Longest ``Retry-After`` (seconds) waited out in place; a longer one keeps the message
for a later refresh, so the consumer (and the Alertmanager sink after it) is not held."""


def slack_escape(text: str) -> str:
    """``text`` as Slack's formatting reads it literally: ``&``, ``<`` and ``>`` escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _where(finding: Finding) -> str:
    subject = finding.subject
    parts = [subject.node, subject.device,
             f"{subject.pod.namespace}/{subject.pod.name}" if subject.pod else None,
             subject.queue]
    return " ".join(part for part in parts if part)


def _head(head: str, cluster: str) -> str:
    """A message's leading ``[FIRING critical]``, with the cluster where one is named:
    ``[FIRING critical] prod-east:`` (a channel several clusters post to)."""
    return f"[{head}] {cluster}:" if cluster else f"[{head}]"


def slack_message(finding: Finding, cluster: str = "") -> dict[str, Any]:
    """The Slack-compatible body for ``finding``; ``cluster`` (``GPUSTEWARD_CLUSTER``), when
    set, leads the text and is a field, and rides along beside the finding as
    ``gpusteward_cluster``.

    An idle holder's message says what its owner's Event says (:func:`owner_notice`): what
    was seen, what happens next and how to keep the GPU, not only the finding's summary."""
    firing = finding.state == "firing"
    head = _head(f"FIRING {finding.severity}" if firing else "RESOLVED", cluster)
    text = slack_escape(f"{head} {finding.kind}: {owner_notice(finding) or finding.summary}")
    fields: list[dict[str, Any]] = [{"title": "kind", "value": finding.kind, "short": True},
                                   {"title": "state", "value": finding.state, "short": True}]
    if cluster:
        fields.insert(0, {"title": "cluster", "value": cluster, "short": True})
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
    for field in fields:
        field["value"] = slack_escape(str(field["value"]))
    message = {
        "text": text[:TEXT_LIMIT],
        "attachments": [{
            "color": COLOURS[finding.severity] if firing else RESOLVED_COLOUR,
            "fallback": text[:TEXT_LIMIT],
            "fields": fields,
            "ts": int(finding.ts),
        }],
        "gpusteward": msgspec.to_builtins(finding),
    }
    if cluster:
        message["gpusteward_cluster"] = cluster
    return message


def digest_message(findings: list[Finding], cluster: str = "") -> dict[str, Any]:
    """One message for a burst of findings: the counts by state, severity and kind, then a
    line per finding as long as the text allows, and how many more there were.

    The data rides along under ``gpusteward.findings`` (id, kind, severity, state and
    subject of each, and ``cluster`` where set), the whole findings stay on the topic and
    in Alertmanager."""
    firing = [f for f in findings if f.state == "firing"]
    worst = max((f.severity for f in firing), key=_RANK.__getitem__, default=None)
    counts = Counter((f.state, f.severity, f.kind) for f in findings)
    tally = ", ".join(
        f"{n} {kind} {'resolved' if state == 'resolved' else severity}"
        for (state, severity, kind), n in sorted(
            counts.items(), key=lambda item: (item[0][0], -_RANK[item[0][1]], -item[1])))
    head = _head(f"FIRING {worst}" if worst else "RESOLVED", cluster)
    text = slack_escape(f"{head} {len(findings)} findings at once "
                        f"({len(firing)} firing, {len(findings) - len(firing)} resolved): "
                        f"{tally}")
    shown = 0
    for finding in sorted(findings, key=lambda f: (f.state != "firing", -_RANK[f.severity])):
        state = finding.severity if finding.state == "firing" else "resolved"
        line = slack_escape(f"\n• {state} {finding.kind} {_where(finding)}: {finding.summary}")
        if len(text) + len(line) > TEXT_LIMIT - 200:
            break
        text += line
        shown += 1
    if shown < len(findings):
        text += (f"\n… and {len(findings) - shown} more (gpusteward status, Alertmanager or "
                 "the findings topic list them all)")
    return {
        "text": text,
        "attachments": [{
            "color": COLOURS[worst] if worst else RESOLVED_COLOUR,
            "fallback": text.partition("\n")[0],
            "fields": [{"title": "findings", "value": str(len(findings)), "short": True}],
        }],
        "gpusteward": {"digest": True, **({"cluster": cluster} if cluster else {}),
                       "findings": [
            {"id": f.id, "kind": f.kind, "severity": f.severity, "state": f.state,
             "subject": msgspec.to_builtins(f.subject)} for f in findings]},
    }


@dataclass(frozen=True, slots=True)
class Kept:
    """A message not sent yet, and the (id, state) of each finding it carries."""

    message: dict[str, Any]
    findings: tuple[News, ...]


class WebhookSink:
    """POSTs findings to ``url`` as Slack-compatible JSON, a digest for a burst."""

    def __init__(self, url: str, *, attempts: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 10.0, min_severity: str = "info",
                 min_interval_s: float = MIN_INTERVAL_S, cluster: str = "",
                 digest_every_s: float = DIGEST_EVERY_S) -> None:
        """``min_severity``: findings below it (info < warning < critical) are not sent.
        ``min_interval_s``: least seconds between two posts (Slack's rate). ``cluster``:
        the cluster every message names (empty: none named). ``digest_every_s``: the
        window of the message budget and the least time between two digests."""
        self.url = url
        self.cluster = cluster
        self.shown = shown_url(url)
        """Where log lines say the messages go: the path and query are the credential."""
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.min_rank = _RANK[min_severity]
        self.min_interval_s = min_interval_s
        self.digest_every_s = digest_every_s
        self.unsent: list[Kept] = []
        self._sent: deque[float] = deque()
        """Monotonic time of each message (not digest) sent within ``digest_every_s``."""
        self._gathered: list[Finding] = []
        """Findings past the budget, for the next digest."""
        self._digest_at = 0.0
        """Monotonic time at which the gathered findings are posted."""
        self._last_digest: float | None = None
        self._session: aiohttp.ClientSession | None = None
        self._next_post = 0.0
        """Monotonic time before which no post is made (the pace, or a ``Retry-After``)."""
        self._refused: set[int] = set()
        """Statuses of refusals already logged: a revoked webhook is said once."""

    def _wanted(self, findings: Iterable[Finding]) -> list[Finding]:
        # A resolution is sent whatever its severity: its firing record passed the filter.
        return [f for f in findings
                if f.state == "resolved" or _RANK[f.severity] >= self.min_rank]

    async def deliver(self, finding: Finding) -> None:
        await self.deliver_many([finding])

    async def deliver_many(self, findings: list[Finding]) -> None:
        """Send a consumer batch's new findings: a message per finding, or per node's
        findings of one kind, while the budget lasts (:data:`DIGEST_OVER` per
        ``digest_every_s``), else gathered into a digest, posted at once when no digest went
        out within ``digest_every_s``, otherwise when that is over (by :meth:`refresh`)."""
        wanted = self._wanted(findings)
        if not wanted:
            return
        now = time.monotonic()
        while self._sent and now - self._sent[0] >= self.digest_every_s:
            self._sent.popleft()
        by_node: dict[tuple[str, ...], list[Finding]] = {}
        for finding in wanted:
            # A node's devices together; a pod's finding alone (its text is its owner's).
            subject = finding.subject
            where = subject.node if subject.node and subject.pod is None else finding.id
            by_node.setdefault((finding.state, finding.severity, finding.kind, where),
                               []).append(finding)
        storming = bool(self._gathered) or (self._last_digest is not None
                                            and now - self._last_digest < self.digest_every_s)
        if not storming and len(self._sent) + len(by_node) <= DIGEST_OVER:
            for group in by_node.values():
                self._sent.append(now)
                await self._post(self._message(group))
            return
        if not self._gathered:
            self._digest_at = (now if self._last_digest is None
                               else max(now, self._last_digest + self.digest_every_s))
        self._gathered.extend(wanted)
        await self._post_gathered()

    async def _post_gathered(self, force: bool = False) -> None:
        """Post the gathered findings as one digest (one message if only one) when due, or
        at once with ``force``."""
        if not self._gathered or (not force and time.monotonic() < self._digest_at):
            return
        gathered, self._gathered = self._gathered, []
        self._last_digest = time.monotonic()
        await self._post(self._message(gathered))

    def _message(self, findings: list[Finding]) -> Kept:
        """One finding's message, or a digest of several."""
        return Kept(digest_message(findings, self.cluster) if len(findings) > 1
                    else slack_message(findings[0], self.cluster), tuple(map(news, findings)))

    async def _post(self, kept: Kept) -> None:
        # Behind messages kept from a failure: in order, and a receiver that is down costs
        # the refresh one timeout rather than every new finding its retries.
        if self.unsent or not await self._send(kept.message):
            self.unsent.append(kept)

    def holding(self) -> set[News]:
        """:func:`~gpusteward.alerting.consumer.news` of every finding whose message is
        kept, not sent yet: the consumer commits no further than the oldest of their
        records, so none is lost to a restart."""
        return ({key for kept in self.unsent for key in kept.findings}
                | {news(finding) for finding in self._gathered})

    async def refresh(self, force: bool = False) -> None:
        """Try the messages that could not be sent earlier, oldest first, as far as the
        pace and a ``Retry-After`` allow now (the consumer calls it every poll, so a backlog
        drains at the webhook's rate without holding it); ``force`` waits its turn. The
        gathered findings are posted once their digest is due (with ``force``, now)."""
        await self._post_gathered(force)
        while self.unsent:
            if not force and time.monotonic() < self._next_post:
                return
            if not await self._send(self.unsent[0].message, attempts=1):
                return
            self.unsent.pop(0)

    async def close(self) -> None:
        if self.unsent or self._gathered:
            log.warning("webhook %s: %d message(s) and %d finding(s) gathered for a digest "
                        "not sent as the process stops; the consumer committed no further "
                        "than their findings, so the next start reads them again and sends "
                        "them", self.shown, len(self.unsent), len(self._gathered))
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _wait_turn(self) -> None:
        wait = self._next_post - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _send(self, message: dict[str, Any], attempts: int | None = None) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        tries = attempts or self.attempts
        attempt = 0
        while True:
            await self._wait_turn()
            after = self.backoff_s * 2 ** attempt
            try:
                async with self._session.post(self.url, json=message) as response:
                    self._next_post = time.monotonic() + self.min_interval_s
                    if response.status < 300:
                        return True
                    problem = f"answered {response.status}: {(await response.text())[:200]}"
                    if response.status == 429:
                        asked = retry_after(response.headers.get("Retry-After"))
                        after = asked if asked is not None else after
                        # Slack's rate limit: waiting as asked is no failed attempt.
                        if asked is not None and asked <= MAX_RETRY_AFTER_S:
                            self._next_post = time.monotonic() + max(asked,
                                                                     self.min_interval_s)
                            continue
                    elif 400 <= response.status < 500:
                        self._refusal(response.status, problem)
                        return True
            except aiohttp.InvalidURL:
                problem = "not an http(s) URL"
            except (aiohttp.ClientError, TimeoutError) as error:
                problem = without_url(str(error), self.url) or type(error).__name__
            attempt += 1
            self._next_post = max(self._next_post, time.monotonic() + after)
            if attempt >= tries or after > MAX_RETRY_AFTER_S:
                break
        log.warning("webhook %s: %s; the message is kept for the next refresh", self.shown,
                    problem)
        return False

    def _refusal(self, status: int, problem: str) -> None:
        """Say once per status that the receiver drops messages for good."""
        if status in self._refused:
            log.debug("webhook %s rejected a message (%s); dropping it", self.shown, problem)
            return
        self._refused.add(status)
        gone = (" (the webhook was revoked or its URL is wrong: every message is dropped "
                "until GPUSTEWARD_WEBHOOK_URL is fixed)" if status in (403, 404, 410) else "")
        log.error("webhook %s rejected a message (%s); dropping it%s", self.shown, problem,
                  gone)


_RANK = {"info": 0, "warning": 1, "critical": 2}
