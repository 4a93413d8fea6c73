"""Builders shared by tests: tiny models, PEFT adapters."""
