"""gpusteward: steward of a Kubernetes GPU fleet, as a stream of events."""
