"""The live rules' definitions the weekly report shares: queue SLOs and the idle threshold.

Out of the box the report once judged queues against its own table (exact names,
1 h for the rest) while the live queue rule used the policy's patterns (prod
10 min, research 2 h): the alert and the report disagreed about the same queue.
Here the report takes both from the rule policy the worker loads
(``GPUSTEWARD_POLICY_FILE``, read by the CLI through
:mod:`gpusteward.streams.policy_file`), resolved exactly as the fleet agent
resolves it (:class:`gpusteward.streams.fleet.FleetEvaluator`: the rule layer,
no overrides, because its rule runs fleet-wide). The idle threshold follows the
idle rule's rule-level setting unless the report's settings name one.
"""

from __future__ import annotations

from gpusteward.reports.settings import ReportSettings
from gpusteward.rules import idle, queue
from gpusteward.rules.policy import Policy


def queue_slos(policy: Policy) -> queue.QueueSloSettings:
    """The queue SLO rule's settings, as the fleet agent resolves them."""
    return policy.resolve().of(queue.WAIT_KIND, queue.QueueSloSettings)


def idle_threshold_pct(policy: Policy) -> float:
    """The idle rule's activity threshold (percent) at the rule level of ``policy``."""
    return policy.resolve().of(idle.KIND, idle.IdleSettings).threshold_pct


def aligned(settings: ReportSettings, policy: Policy) -> ReportSettings:
    """``settings`` with the idle threshold of ``policy`` unless they set their own."""
    if "idle_threshold_pct" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"idle_threshold_pct": idle_threshold_pct(policy)})
