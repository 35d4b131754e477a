"""The simulated world: what stands in for GPUs, kubelets, exporters and the API server.

The simulator, the fake NVML, dcgm-exporter pages, the Kubernetes API-server
double, public traces replayed as collector output, synthetic rollups, and the
demo that runs the pipeline against them. Production code never imports this
package (the architecture test checks it); the demo, the tests and the
benchmarks do.
"""

import os as _os

# The sandbox runs gRPC servers and clients (the kubelet sockets) in the process that
# starts the deployed processes: a fork while gRPC's poller runs can abort the child
# before it execs (grpcio's epoll EBADF after fork, grpc/grpc#43055). Every child here
# execs at once, so gRPC's fork handlers are not wanted; they are read when grpc loads.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
