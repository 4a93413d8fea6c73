"""Adapter evaluation: scorers, an eval-set runner over the gateway, and canary comparison."""
