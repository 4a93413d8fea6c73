"""The operator's side of lorafleet: the ``lorafleet`` command (launcher and admin CLI) and the
evaluation harness it runs through the gateway. Not a service: it talks to the services over
NATS and HTTP like any client, and imports only ``shared/``."""
