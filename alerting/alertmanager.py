"""Alertmanager sink: findings become Alertmanager v2 alerts.

Alertmanager identifies an alert by its label set, so a finding's labels are
built from what names the problem (kind, fingerprint, subject) and are kept
exactly as first sent: the resolved record of an episode carries severity
``info`` in the findings topic, and sending that would open a second alert
instead of ending the first. A resolved finding ends its alert by re-posting
the firing labels with ``endsAt`` set to the finding's end. An episode re-issued at
another severity (the idle rule's warning after its notice) is a new label set, so its
alert replaces the old one: the old is ended in the same post. Several clusters may share
one Alertmanager: each pipeline's ``GPUSTEWARD_CLUSTER`` is its alerts' ``cluster`` label,
so same-named nodes in two clusters are two alerts, never one that either may end.

Firing alerts are posted with ``endsAt`` a few resend intervals ahead (as
Prometheus does), and :meth:`AlertmanagerSink.refresh` re-posts them before
that passes; if this process dies, its alerts resolve by themselves when
``endsAt`` passes instead of firing forever. A failed post is not lost: the
alert stays pending and the next refresh posts it again; after a failure the sink
makes no request to that Alertmanager for a quarter of the resend interval (15 s), so
that one that hangs costs one timeout per 15 s, not one per finding. When a resolved
finding arrives for an episode this process never saw fire (it restarted),
the sink asks Alertmanager for the active alerts with that fingerprint (and its
cluster label) and ends those. On start the consumer hands the sink the findings still
open on the topic (:meth:`AlertmanagerSink.restore`), which it keeps alive from its first
refresh: without them a restart let every open alert lapse at ``endsAt``, announced as
resolved.

An HA Alertmanager's replicas gossip silences and the notification log, not alerts, so
every alert goes to every replica (:func:`parse_targets`: a comma-separated list, and
``dns+`` entries whose addresses are looked up again at each refresh). Each replica has
its own back-off and unsent resolutions; all are posted to at once, and one that failed
is re-sent everything by the refresh in the background, so one that is down or hangs
holds neither the others nor the consumer back. Resolving after a restart asks all of
them. Each replica is re-sent every firing alert once per resend interval, whatever
else was posted to it meanwhile (new findings' posts do not count as the re-send).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from gpusteward.errors import ConfigError, GpustewardError, shown_url, without_url
from gpusteward.rules.idle import owner_notice
from gpusteward.schema import Finding

log = logging.getLogger(__name__)


def rfc3339(ts: float) -> str:
    """Unix seconds as the RFC 3339 UTC timestamp Alertmanager expects."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def alert_labels(finding: Finding, cluster: str = "") -> dict[str, str]:
    """The identifying labels of a finding's alert; ``cluster`` (``GPUSTEWARD_CLUSTER``), when
    set, is its ``cluster`` label: a finding's fingerprint names its kind, node, device and
    pod only, so two clusters with the same node names sharing one Alertmanager would
    otherwise post the same label set, one alert, and each end the other's."""
    labels = {
        "alertname": f"GpuSteward{''.join(p.title() for p in finding.kind.split('_'))}",
        "kind": finding.kind,
        "severity": finding.severity,
        "fingerprint": finding.fingerprint,
        "source": "gpusteward",
    }
    if cluster:
        labels["cluster"] = cluster
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


SETTING = "GPUSTEWARD_ALERTMANAGER_URL"
"""Where the Alertmanager URLs come from; errors about them name it."""


@dataclass(frozen=True)
class Target:
    """One entry of the Alertmanager URL list: a base URL, or with ``dns`` a host whose
    A/AAAA records are the replicas (``dns+http://alertmanager-operated.monitoring:9093``)."""

    url: str
    """The base URL, without ``dns+`` and a trailing ``/``."""
    dns: bool = False


def _shown_entry(entry: str) -> str:
    """An entry of the list as an error shows it: :func:`shown_url` where it reads as a
    URL, the entry itself where it holds no ``@`` (no password), else nothing of it."""
    shown = shown_url(entry.removeprefix("dns+"), keep_path=True)
    if shown != "<unreadable URL>":
        return ("dns+" if entry.startswith("dns+") else "") + shown
    return repr(entry) if "@" not in entry else "<unreadable URL>"


def parse_targets(value: str, setting: str = SETTING) -> list[Target]:
    """The comma-separated Alertmanager URLs of ``value``; :class:`ConfigError` naming
    ``setting`` and the bad entry (never its password) for one that cannot be used.

    An entry is ``http(s)://host[:port][/path]`` (one Alertmanager) or
    ``dns+http(s)://host:port[/path]``: every A/AAAA record of ``host``, looked up again at
    each refresh, is one replica (a headless Service's pods). Alertmanager replicas gossip
    silences and notifications, not alerts: a client must post every alert to all of them.
    """
    targets: list[Target] = []
    entries = [entry.strip() for entry in value.split(",")]
    if not any(entries):
        raise ConfigError(f"{setting} is empty: give one Alertmanager base URL or more, "
                          "comma-separated (http://alertmanager:9093)")
    for number, entry in enumerate(entries, 1):
        where = f"{setting} entry {number} of {len(entries)}"
        if not entry:
            raise ConfigError(f"{where} is empty (a stray comma?)")
        dns = entry.startswith("dns+")
        url = entry.removeprefix("dns+").rstrip("/")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as error:
            raise ConfigError(f"{where} ({_shown_entry(entry)}) is no URL: "
                              f"{without_url(str(error), url)}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where} ({_shown_entry(entry)}) is no http(s) URL: write "
                              "http://host:port, or dns+http://host:port for every address "
                              "of a headless Service")
        if parts.query or parts.fragment:
            raise ConfigError(f"{where} ({_shown_entry(entry)}) has a query or fragment: "
                              "give the base URL (/api/v2/alerts is added)")
        if dns and port is None:
            raise ConfigError(f"{where} ({_shown_entry(entry)}) has no port: a dns+ entry "
                              "needs one (dns+http://alertmanager-operated.monitoring:9093)")
        target = Target(url, dns)
        if target not in targets:
            targets.append(target)
    return targets


@dataclass
class Replica:
    """One Alertmanager the sink posts to, with its own back-off and unsent resolutions."""

    url: str
    """Base URL as requested (a ``dns+`` entry's host replaced by one of its addresses)."""
    shown: str
    """The URL as messages show it: without ``user:password@``."""
    server_hostname: str | None = None
    """For HTTPS to an address looked up from a name: the name its certificate holds."""
    host_header: str | None = None
    last_resend: float = 0.0
    """When every firing alert was last posted to it (clock seconds)."""
    has: set[str] = field(default_factory=set)
    """Fingerprints of the firing alerts it has accepted (a subset of the sink's
    ``firing``); one missing is posted by the next refresh."""
    pending_resolved: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Resolved alerts this replica has not accepted yet, by fingerprint."""
    failures: int = 0
    """Posts that failed in a row; while above 0 the replica is posted to only by the
    refresh, in the background, so a replica that hangs holds up no other."""
    retry_at: float = 0.0
    """After a failed request, no other is made to this replica before this (clock
    seconds); what arrives meanwhile is sent by the refresh after it."""
    inflight: asyncio.Task[None] | None = None
    """Its background re-send while it recovers: nothing else is posted to it meanwhile."""

    def ready(self, now: float) -> bool:
        """Whether a request may be made to it now: not backing off, none in flight."""
        return now >= self.retry_at and (self.inflight is None or self.inflight.done())


def _with_host(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address`` (its ``user:password@`` kept)."""
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    host = f"[{address}]" if ":" in address else address
    netloc = (f"{userinfo}@" if userinfo else "") + f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class AlertmanagerSink:
    """Posts findings to every Alertmanager replica's ``/api/v2/alerts`` and keeps firing
    ones alive."""

    def __init__(self, url: str, *, resend_interval_s: float = 60.0,
                 lifetime_intervals: float = 4.0, generator_url: str = "",
                 timeout_s: float = 10.0, clock: Any = time.time,
                 resolve: Any = None, cluster: str = "") -> None:
        """``url``: the Alertmanager base URLs, comma-separated (:func:`parse_targets`:
        ``http://alertmanager:9093``, ``dns+http://alertmanager-operated.monitoring:9093``);
        a list that cannot be used raises :class:`ConfigError`.

        ``resend_interval_s``: how often firing alerts are re-posted (and ``dns+`` names
        looked up again), seconds; ``lifetime_intervals``: ``endsAt`` of a firing alert is
        this many intervals ahead, so a few lost posts do not resolve it (Prometheus
        uses 4); ``generator_url``: a link to where the finding can be seen
        (a dashboard); the fingerprint is appended as ``?fingerprint=``; ``resolve``: an
        async ``(host, port) -> [address]`` for ``dns+`` entries (default: the system
        resolver's A and AAAA records); ``cluster``: the ``cluster`` label of every alert,
        and the only cluster whose alerts it ends after a restart (empty: no label, and it
        ends only alerts without one).
        """
        self.targets = parse_targets(url)
        self.cluster = cluster
        self.resend_interval_s = resend_interval_s
        self.lifetime_s = resend_interval_s * lifetime_intervals
        self.generator_url = generator_url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.clock = clock
        self.resolve = resolve or _addresses
        self.firing: dict[str, dict[str, Any]] = {}
        """Alerts kept alive, by finding fingerprint."""
        self.replicas: dict[str, Replica] = {}
        """The Alertmanagers posted to, by URL: the static entries, and the addresses of
        the ``dns+`` ones as last looked up."""
        self._looked_up_at: float | None = None
        self._unplaced: dict[str, list[dict[str, Any]]] = {}
        """Resolutions that came while no replica was known (a ``dns+`` name not yet
        looked up): the first replicas found are sent them."""
        self._session: aiohttp.ClientSession | None = None

    @property
    def pending_resolved(self) -> dict[str, list[dict[str, Any]]]:
        """Resolved alerts not yet accepted by every replica, by fingerprint."""
        pending: dict[str, list[dict[str, Any]]] = dict(self._unplaced)
        for replica in self.replicas.values():
            for fingerprint, ended in replica.pending_resolved.items():
                pending.setdefault(fingerprint, ended)
        return pending

    async def discover(self) -> None:
        """Bring :attr:`replicas` up to date: look the ``dns+`` names up again. A replica
        that is no longer there is dropped, a new one starts with nothing sent (the next
        refresh posts it every firing alert); a name that cannot be looked up keeps the
        replicas it had, with a warning."""
        urls: list[str] = []
        for target in self.targets:
            if not target.dns:
                urls.append(target.url)
                self.replicas.setdefault(target.url, Replica(
                    target.url, shown_url(target.url, keep_path=True),
                    last_resend=self.clock()))
                continue
            parts = urlsplit(target.url)
            host, port = parts.hostname or "", parts.port or 0
            try:
                async with asyncio.timeout(self.timeout.total):
                    addresses = await self.resolve(host, port)
            except OSError as error:  # TimeoutError included
                kept = [u for u, r in self.replicas.items() if r.host_header == f"{host}:{port}"]
                log.warning("cannot look up the Alertmanagers of dns+%s (%s); posting to the "
                            "%d address(es) it had", shown_url(target.url, keep_path=True),
                            str(error) or "timed out", len(kept))
                urls.extend(kept)
                continue
            for address in addresses:
                replica_url = _with_host(target.url, address)
                urls.append(replica_url)
                self.replicas.setdefault(replica_url, Replica(
                    replica_url, shown_url(replica_url, keep_path=True),
                    server_hostname=host if parts.scheme == "https" else None,
                    host_header=f"{host}:{port}", last_resend=self.clock()))
        for url, gone in self.replicas.items():
            if url not in urls and gone.inflight is not None:
                gone.inflight.cancel()
        self.replicas = {u: self.replicas[u] for u in dict.fromkeys(urls)}
        self._looked_up_at = self.clock()
        if self.replicas and self._unplaced:
            for replica in self.replicas.values():
                for fingerprint, ended in self._unplaced.items():
                    replica.pending_resolved.setdefault(fingerprint, ended)
            self._unplaced.clear()

    def _alert(self, finding: Finding) -> dict[str, Any]:
        """A firing finding's alert, without ``endsAt``."""
        return {"labels": alert_labels(finding, self.cluster),
                "annotations": alert_annotations(finding),
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
        """Post the alerts of ``findings`` (a consumer batch, in record order) in one
        request to each replica, to all at once.

        An episode that both fires and resolves in the batch is posted once, as resolved.
        A failed post loses nothing: firing alerts stay in :attr:`firing` and a replica's
        unsent resolutions in its ``pending_resolved``, and the next refresh posts them.
        """
        if self._looked_up_at is None:
            await self.discover()
        posting: dict[str, list[dict[str, Any]]] = {}
        resolved: dict[str, list[dict[str, Any]]] = {}
        superseded: list[dict[str, Any]] = []
        for finding in findings:
            fingerprint = finding.fingerprint
            if finding.state == "firing":
                alert = self._alert(finding)
                known = self.firing.get(fingerprint)
                if known is not None and known["labels"] != alert["labels"]:
                    # Re-issued at another severity (an idle episode's warning after its
                    # notice): a new label set is a new alert, so the old one is ended
                    # now rather than left to lapse at its endsAt. (Unsent, it lapses.)
                    superseded.append({**known, "endsAt": rfc3339(finding.ts)})
                self.firing[fingerprint] = alert
                resolved.pop(fingerprint, None)
                for replica in self.replicas.values():
                    replica.pending_resolved.pop(fingerprint, None)
                posting[fingerprint] = [self._alive(alert)]
                continue
            ends_at = finding.ends_at if finding.ends_at is not None else finding.ts
            known = self.firing.pop(fingerprint, None)
            if known is not None:
                ended = [{**known, "endsAt": rfc3339(ends_at)}]
            else:
                ended = await self._active_alerts_for(finding, ends_at)
            resolved[fingerprint] = ended
            posting[fingerprint] = ended
        for fingerprint in self._unplaced.keys() & posting.keys():
            del self._unplaced[fingerprint]
        if not self.replicas:
            self._unplaced.update(resolved)
        for replica in self.replicas.values():
            replica.pending_resolved.update(resolved)
            replica.has.difference_update(resolved)
        alerts = [*superseded, *(alert for group in posting.values() for alert in group)]
        if not alerts:
            return
        opened = [fingerprint for fingerprint in posting if fingerprint not in resolved]
        now = self.clock()
        # A replica that failed gets these from its refresh (it has them pending, or misses
        # them from ``has``): a post to one that hangs held the batch for its timeout.
        await asyncio.gather(*(self._post_one(r, alerts, opened, resolved)
                               for r in self.replicas.values()
                               if r.failures == 0 and r.ready(now)))

    async def refresh(self, force: bool = False) -> None:
        """Re-post every firing alert (and unsent resolutions) to each replica a resend
        interval after the last time, or at once to one that misses some, looking the
        ``dns+`` names up again first; ``force``: to every replica now, a back-off after a
        failure included. A replica that failed is posted to in the background."""
        now = self.clock()
        if (self._looked_up_at is None or force
                or now - self._looked_up_at >= self.resend_interval_s):
            await self.discover()
        waiting = []
        for replica in list(self.replicas.values()):
            if force:
                if replica.inflight is not None:
                    await replica.inflight
                replica.retry_at = 0.0
            if not replica.ready(now):
                continue
            # ``has`` holds only firing fingerprints: fewer means some are missing.
            due = (force or replica.pending_resolved or len(replica.has) < len(self.firing)
                   or now - replica.last_resend >= self.resend_interval_s)
            if not due:
                continue
            alerts = [self._alive(a) for a in self.firing.values()]
            for ended in replica.pending_resolved.values():
                alerts.extend(ended)
            if not alerts:
                replica.last_resend = now
                continue
            post = self._post_one(replica, alerts, list(self.firing),
                                  dict(replica.pending_resolved), resend=True)
            if replica.failures and not force:
                replica.inflight = asyncio.create_task(post)
            else:
                waiting.append(post)
        await asyncio.gather(*waiting)

    async def close(self) -> None:
        """Wait for the background re-sends (each within its timeout), then close."""
        for replica in self.replicas.values():
            if replica.inflight is not None:
                await replica.inflight
                replica.inflight = None
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

    def _request(self, replica: Replica) -> dict[str, Any]:
        """The keyword arguments that reach ``replica`` by the name of its ``dns+`` entry."""
        extra: dict[str, Any] = {}
        if replica.host_header:
            extra["headers"] = {"Host": replica.host_header}
        if replica.server_hostname:
            extra["server_hostname"] = replica.server_hostname
        return extra

    async def post(self, replica: Replica, alerts: list[dict[str, Any]]) -> None:
        """POST ``alerts`` to ``replica``; raise :class:`AlertmanagerError` unless it
        accepts them."""
        try:
            async with self._client().post(f"{replica.url}/api/v2/alerts", json=alerts,
                                           **self._request(replica)) as response:
                if response.status != 200:
                    body = (await response.text())[:300]
                    raise AlertmanagerError(f"Alertmanager at {replica.shown} answered "
                                            f"{response.status}: {body}")
        except aiohttp.ClientError as error:
            raise AlertmanagerError(f"cannot reach Alertmanager at {replica.shown}: "
                                    f"{without_url(str(error), replica.url, keep_path=True)}"
                                    ) from error
        except TimeoutError as error:
            raise AlertmanagerError(f"Alertmanager at {replica.shown} did not answer in "
                                    f"{self.timeout.total:g} s") from error

    def _failed(self, replica: Replica) -> None:
        # One request per retry interval while a replica fails: a hung one costs the
        # consumer a timeout per request, and a burst of findings posted one by one behind
        # it held every sink (and the findings after) for hours. The other replicas are
        # posted to at the same time and keep their own pace.
        replica.retry_at = self.clock() + self.resend_interval_s / 4
        replica.failures += 1

    async def _post_one(self, replica: Replica, alerts: list[dict[str, Any]],
                        opened: list[str], resolutions: dict[str, list[dict[str, Any]]],
                        *, resend: bool = False) -> None:
        """Post ``alerts`` (those firing of ``opened``, the ended ones of ``resolutions``)
        to ``replica``; ``resend``: every firing alert. A failure is logged and backs the
        replica off; what it did not take stays missing or pending for its next refresh."""
        started = self.clock()
        try:
            await self.post(replica, alerts)
        except AlertmanagerError as error:
            self._failed(replica)
            log.warning("%s; %d alert(s) will be re-sent on its next refresh", error,
                        len(alerts))
            return
        replica.failures = 0
        replica.has.update(f for f in opened if f in self.firing)
        for fingerprint, ended in resolutions.items():
            if replica.pending_resolved.get(fingerprint) is ended:
                del replica.pending_resolved[fingerprint]
        if resend:
            replica.last_resend = started

    async def _active_alerts_for(self, finding: Finding, ends_at: float) -> list[dict[str, Any]]:
        """Every replica's active alerts for ``finding``'s fingerprint, ended at
        ``ends_at``: a replica may hold an alert another lost in a restart."""
        fallback = [{"labels": alert_labels(finding, self.cluster),
                     "annotations": alert_annotations(finding),
                     "startsAt": rfc3339(finding.starts_at), "endsAt": rfc3339(ends_at),
                     "generatorURL": self._generator(finding)}]
        now = self.clock()
        asking = [r for r in self.replicas.values() if r.ready(now)]
        answers = await asyncio.gather(*(self._active_on(r, finding) for r in asking))
        found: dict[frozenset[tuple[str, str]], dict[str, Any]] = {}
        for active in answers:
            for a in active or []:
                found.setdefault(frozenset(a["labels"].items()), {
                    "labels": a["labels"], "annotations": a.get("annotations", {}),
                    "startsAt": a["startsAt"], "endsAt": rfc3339(ends_at),
                    "generatorURL": a.get("generatorURL", "")})
        if not any(answer is not None for answer in answers):
            # No replica answered: the finding's own labels, right unless severity changed.
            return fallback
        return list(found.values())

    async def _active_on(self, replica: Replica, finding: Finding
                         ) -> list[dict[str, Any]] | None:
        """``replica``'s active alerts with ``finding``'s fingerprint and this sink's
        ``cluster`` label (none when it has no cluster: ``cluster=""`` matches an absent
        label); None if it did not answer. Another cluster's alert with the same fingerprint
        (the same node names) is not this finding's to end."""
        params = [("filter", f'fingerprint="{finding.fingerprint}"'),
                  ("filter", f'cluster="{_quoted(self.cluster)}"'),
                  ("silenced", "true"), ("inhibited", "true")]
        try:
            async with self._client().get(f"{replica.url}/api/v2/alerts", params=params,
                                          **self._request(replica)) as response:
                if response.status != 200:
                    raise AlertmanagerError(f"Alertmanager answered {response.status}")
                active: list[dict[str, Any]] = await response.json()
        except (aiohttp.ClientError, AlertmanagerError, TimeoutError) as error:
            self._failed(replica)
            log.warning("cannot look up alerts to resolve %s at %s: %s", finding.fingerprint,
                        replica.shown,
                        without_url(str(error), replica.url, keep_path=True) or "timed out")
            return None
        return active


def _quoted(value: str) -> str:
    """``value`` inside an Alertmanager matcher's double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


async def _addresses(host: str, port: int) -> list[str]:
    """The A and AAAA addresses of ``host``, each once, in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                         type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))
