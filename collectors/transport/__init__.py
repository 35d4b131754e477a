"""How a collector's records reach Kafka, and survive while Kafka is away.

- :mod:`.publisher`: the :class:`~.publisher.Publisher` protocol every source
  publishes through, and :class:`~.publisher.KafkaPublisher`, which batches,
  retries with back-off and counts what it sent, held back and dropped;
- :mod:`.spool`: the ordered, size-bounded buffer (in memory or on disk) the
  publisher keeps undelivered records in.

The process's own metrics stay in :mod:`gpusteward.collectors.metrics`: one
:class:`~gpusteward.collectors.metrics.CollectorMetrics` per process holds both
the transport's counters and the source loop's, on one registry served on one
``/metrics``; putting it here would make the source loop reach into the
transport for its read-error counters.
"""
