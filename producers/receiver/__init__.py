"""The lifecycle-plane HTTP receiver: Alertmanager, MLflow and release webhooks into Kafka.

``config`` its settings, ``alertmanager`` and ``mlflow`` the pure payload → event mappings,
``server`` the aiohttp service. Importing the package loads none of them.
"""
