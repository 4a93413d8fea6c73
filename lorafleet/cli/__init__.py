"""The lorafleet command: launcher and admin CLI."""
