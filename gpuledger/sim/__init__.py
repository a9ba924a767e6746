"""A simulated GPU cluster that drives gpuledger's real collectors (``gpuledger exercise``).

``kube_api`` (a Kubernetes API server over HTTP) and ``kubelet`` (a kubelet
pod-resources gRPC server per node) speak the real wire protocols; ``cluster``
composes them with webhook calls into the receiver; ``scenario`` is the validated
YAML format of a scripted exercise.
"""
