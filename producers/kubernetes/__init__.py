"""The scheduler collector: Kubernetes Pods, Events and Kueue Workloads as scheduler events.

``config`` its settings, ``mapping`` the pure object → event functions, ``collector`` the
list+watch loop. Importing the package loads none of them (the CLI imports lazily).
"""
