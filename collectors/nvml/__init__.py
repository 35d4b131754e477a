"""The NVML collector: per-GPU and per-MIG-device readings, and hardware events at once.

Its modules follow the data:

- :mod:`.api`: the :class:`Nvml` Protocol, the part of ``pynvml`` it calls,
  which the real module and the sandbox's fake both satisfy;
- :mod:`.reader`: one blocking pass over every GPU and MIG device, in a
  worker thread;
- :mod:`.events`: the ``nvmlEventSetWait`` listener thread and the rules that
  turn NVML events and growing counters into XID, ECC, throttle and
  lost-GPU events, each once;
- :mod:`.collector`: :class:`NvmlCollector`, a source on the shared tick loop
  (:mod:`gpusteward.collectors.source`) with pod attribution, and
  :func:`run_nvml_collector`, the ``gpusteward collect nvml`` runner.
"""

from gpusteward.collectors.nvml.api import Nvml, NvmlUnavailable
from gpusteward.collectors.nvml.collector import NvmlCollector, run_nvml_collector

__all__ = ["Nvml", "NvmlCollector", "NvmlUnavailable", "run_nvml_collector"]
