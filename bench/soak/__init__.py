"""Soak: mixed load for a long while (30 minutes by default) while every service's RSS and open-file
count is sampled; after warm-up both must stay flat.

``python -m bench.soak --minutes 30`` (``make soak``; not part of ``make test``) starts the stack,
registers adapters through the registry, sends one request to each, eight at a time (so preallocated
adapter slots are in use and the worker has run large batches before sampling starts), then runs
``bench.load``'s open-loop generator at a moderate rate for the whole time. Every few seconds it
samples /proc/<pid> of the five services (and of nats-server and redis-server, reported for
information) and reports per process the figures at start, at the end of warm-up and at the end,
the growth and the least-squares slope after warm-up. The worker runs with small caches (few adapter
slots, a small CPU tier, a small KV cache) so that their steady state, adapters loaded and evicted,
is reached within the warm-up. Writes bench/results/soak.json, .md and .png; exits 1 when a service
is not flat or a request was lost.
"""
