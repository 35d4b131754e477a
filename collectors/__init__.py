"""Edge collectors: they turn a data source into samples and events on Kafka.

Every collector publishes the same contract (:mod:`gpusteward.schema`)
through :mod:`gpusteward.collectors.transport.publisher`, so the stream worker cannot
tell the simulator from NVML, dcgm-exporter or Prometheus.
"""
