"""lorafleet's common package: config, message schemas, subjects, bus and Redis helpers, logging, errors."""
