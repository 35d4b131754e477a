"""The kubelet PodResources API v1: its .proto and the modules grpcio-tools generates from it.

``api_pb2*.py`` are generated; do not edit them. Regenerate with
``make podresources-proto`` after changing ``api.proto``. The client that
turns the kubelet's answer into device-to-pod attribution is
:mod:`gpusteward.collectors.attribution`.
"""
