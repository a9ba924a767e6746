"""Collectors: publish facts from external systems to Kafka under the shared key."""
