"""Durable audit trail: hash-chained log of every completion, rejection and registry change."""
