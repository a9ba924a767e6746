"""Kubelet PodResources v1 protobuf/gRPC definitions and generated stubs."""
