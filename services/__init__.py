"""The five lorafleet services and the lorafleet command."""
