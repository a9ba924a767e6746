"""Correlation: which entity an event belongs to (``routing``), the join rules over an
entity's state (``entities``), every release's state (``release``, ``directory``) and
the Faust agents that run them (``agents``)."""
