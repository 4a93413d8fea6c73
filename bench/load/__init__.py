"""Open-loop load on the OpenAI-compatible API: tenants, zipf adapter popularity over up to 1,000
registered adapters of mixed ranks, Poisson arrivals, a fixed count and duration so it always stops.

``python -m bench.load [--quick]`` starts nats-server, redis-server and the five services on loopback
(or targets a running gateway with ``--url``/``--key``), registers the adapters through the registry,
fires every request at its scheduled time whatever is still in flight, and classifies each as
completed, error (by code) or lost (no answer within the client timeout, or a stream that ended
without a finish). It reports TTFT / TPOT p50/p95/p99 split by cache hit, the cache hit rate,
throughput per adapter and errors by type in bench/results/load.json, .md and .png.
"""
