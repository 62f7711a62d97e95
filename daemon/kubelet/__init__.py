"""cuctxd on Kubernetes, through the engines the kubelet already has: the device plugin that hands client
pods the daemon's socket (:mod:`.device_plugin`, its own process) and the daemon's ``gpu_limit``, which asks
the kubelet's PodResources API which GPUs a client's pod holds (:mod:`.pod_gpus`). Both need the
``kubernetes`` extra (grpcio, protobuf); the modules ``*_pb2*`` are generated (``generate.sh``)."""

#: Where the kubelet serves its PodResources API (the plugin relays it; the daemon's ``pod_resources_socket``).
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
