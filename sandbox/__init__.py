"""The simulated world: what stands in for GPUs, kubelets, exporters and the API server.

The simulator, the fake NVML, the Kubernetes API-server double, public traces
replayed as collector output, synthetic rollups, and the demo that runs the
pipeline against them. Production code never imports this package (the
architecture test checks it); the demo, the tests and the benchmarks do.
"""
