"""The weekly summary posted where people read: a Slack-compatible incoming webhook.

Slack, Mattermost, Rocket.Chat and Teams' Slack-compatible connectors all take
``{"text": "..."}`` with Markdown-like text; the summary is the report's
headline, its top idle holders and top savings, and a link to the full report,
short enough to read in a channel (the full tables stay in the report).
"""

from __future__ import annotations

from typing import Any

import aiohttp

from gpusteward.errors import TemporaryError, without_url
from gpusteward.reports.trends import data_ends_note, gaps_note, missing_note

TOP = 5
"""Idle holders and savings named in the summary."""


def summary(data: dict[str, Any], link: str | None = None) -> str:
    """The Markdown summary of one report's JSON document."""
    totals = data["totals"]
    cluster = f"{data['cluster']} " if data.get("cluster") else ""
    lines = [f"*GPU report {cluster}{data['week']}*: {totals['gpus']} GPUs, "
             f"{totals['allocated_gpu_hours']:,.0f} GPU-h allocated, "
             f"{totals['used_gpu_hours']:,.0f} used, {totals['idle_gpu_hours']:,.0f} idle "
             f"(${totals['idle_cost_usd']:,.0f}); advised saving "
             f"${totals['recommended_saving_usd']:,.0f}/week."]
    if data.get("missing_days"):
        lines.append(f"⚠ {missing_note(data)}")
    if data.get("data_ends"):
        lines.append(f"⚠ {data_ends_note(data)}")
    if data.get("gaps"):
        lines.append(f"⚠ {gaps_note(data)}")
    trends = data.get("trends", {})
    if trends.get("previous_week") and trends.get("not_comparable"):
        lines.append(f"Not comparable with {trends['previous_week']}: "
                     f"{trends['not_comparable']}.")
    holders = data.get("idle_holders", [])[:TOP]
    if holders:
        lines.append("*Top idle holders*")
        lines += [f"• {h['namespace']}/{h['pod']} ({h['team']}): "
                  f"{h['idle_gpu_hours']:,.1f} idle GPU-h, longest {h['longest_episode_h']:,.1f} h"
                  f", {h['status']}" for h in holders]
    actions = sorted((a for t in data.get("actions", []) for a in t["actions"]),
                     key=lambda a: -a["saving_usd"])[:TOP]
    if actions:
        lines.append("*Top savings*")
        lines += [f"• {a['workload']} ({a['team']}): {a['current']} → {a['recommended']}, "
                  f"${a['saving_usd']:,.0f}/week" for a in actions]
    if link:
        lines.append(f"Full report: {link}")
    return "\n".join(lines)


async def post(url: str, text: str, timeout_s: float = 10.0) -> None:
    """POST ``{"text": text}`` to ``url``; a refusal or timeout raises TemporaryError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.post(url, json={"text": text}) as response:
            if response.status >= 300:
                body = (await response.text())[:200]
                raise TemporaryError(f"webhook answered {response.status}: {body}")
    except (TimeoutError, aiohttp.ClientError) as error:
        # The URL is the webhook's credential: an error naming it (an unreadable URL's)
        # says only its host.
        raise TemporaryError(f"webhook not reached: {without_url(str(error), url)}") from error
