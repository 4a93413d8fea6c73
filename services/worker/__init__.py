"""GPU worker: base model, adapter slots, continuous-batching engine."""
