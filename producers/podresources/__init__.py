"""The pod-resources collector: which GPU each container on a node holds, from the kubelet.

``config`` its settings, ``snapshot`` the pure diff of kubelet answers, ``collector`` the
poll loop, ``proto`` the kubelet's gRPC API. Importing the package loads none of them.
"""
