"""The stream worker's own metrics: what it read, wrote and dead-lettered, its lag, rebalances.

One :class:`~gpusteward.metrics.PipelineMetrics` per worker app, wired to
the app's signals here so the agents only count (``outputs.py`` counts what
goes out, the node join what comes in). The lag is the worker group's
committed offsets against the partition ends, read every
:data:`~gpusteward.metrics.LAG_INTERVAL_S` with an admin request by
:func:`~gpusteward.metrics.follow_lag` as every consumer's is, the figure an
operator compares with Kafka's own tools. The ``/metrics`` server and the lag
reading start with the app, before its tables recover, when
``settings.metrics.port`` is set: a worker replaying a long changelog consumes
nothing meanwhile, and its lag says so.
"""

from __future__ import annotations

from typing import Any

from gpusteward import kafka, topics
from gpusteward.metrics import MetricsServer, PipelineMetrics, follow_lag, serve
from gpusteward.settings import Settings

CONSUMED = (topics.SAMPLES, topics.HW_EVENTS, topics.ALLOCATIONS, topics.NODE_SUMMARIES,
            topics.QUEUE)
"""The topics the worker's agents read (node join and fleet agent share one group)."""


def worker_metrics(app: Any, settings: Settings) -> PipelineMetrics:
    """Metrics for ``app``; serves them and follows the lag when a metrics port is set.

    The node join and the fleet agent each build an output writer; both get the app's one
    set (made by the first), so the process serves one registry on one port.
    """
    existing: PipelineMetrics | None = getattr(app, "gpusteward_metrics", None)
    if existing is not None:
        return existing
    metrics = app.gpusteward_metrics = PipelineMetrics()
    group = str(app.conf.id)

    def count_rebalance(sender: Any, *args: Any, **kwargs: Any) -> None:
        metrics.rebalances.labels(group).inc()

    app.on_partitions_assigned.connect(count_rebalance)
    if not settings.metrics.port:
        return metrics
    names = [spec.name(settings) for spec in CONSUMED]
    server: list[MetricsServer] = []

    # From the app's start, not after its table recovery (WorkerApp.early_task): a worker
    # replaying a long changelog is when its metrics, its lag first, are most wanted.
    @app.early_task
    async def serve_metrics() -> None:
        server.append(serve(metrics.registry, settings.metrics.port, settings.metrics.addr))

    @app.early_task
    async def read_lag() -> None:
        async with kafka.GroupOffsets(settings, group, names) as read:
            await follow_lag(metrics, group, read)

    return metrics
