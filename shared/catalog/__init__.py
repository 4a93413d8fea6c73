"""The registry's adapter catalog and every read of it, in one package.

- ``records``: ``Catalog``, the in-memory records (every version of every adapter) and aliases.
- ``access``: ``may_use``, who may use a version (one rule).
- ``rollout``: the deterministic split between a production and a canary version.
- ``resolve``: (tenant, model[@version], request key) -> base model or exact adapter version.
- ``policy``: ``first_match``, the routing rule a request's facts match (gateway and scheduler alike).
- ``routing``: ``Routes``, the task routes and policies, and the routing step before resolution.
- ``grants``: a submission's adapter checked against that resolution (scheduler, worker).
- ``view``: ``CatalogView``, the read model every service but the registry keeps, fed by one KV follower.
- ``barrier``: ``CatalogBarrier``, read-your-writes for every view after a registry write.
- ``signers``: a trusted signer as stored.
"""
