"""Development and test helpers: the local Kafka broker, child-process services, the import-graph checker.

Nothing a deployed component needs lives here, and no producer imports it.
"""
