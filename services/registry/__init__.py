"""Adapter registry and trusted store: records, versions, signatures, lifecycle, resolution."""
