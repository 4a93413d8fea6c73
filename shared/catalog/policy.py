"""Routing policies: the first rule whose match holds for a request. One evaluator, used by the
gateway (HTTP requests, ``/admin/route/explain``) and the scheduler (direct-NATS submissions)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.schemas import PolicyMatch, PolicyRule


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a rule may match: the tenant's tier, the caller's API key, the model as asked, the
    request's metadata and its ``x-`` headers (lower-case names). ``request_key`` (the OpenAI
    ``user``, else the request id) is matched by no rule: an experiment splits by it."""

    tier: str | None = None
    key_id: str | None = None
    model: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    request_key: str | None = None


def matches(match: PolicyMatch, facts: RequestFacts) -> bool:
    """Every field the match gives holds (a match with none holds for every request)."""
    if match.tier is not None and match.tier != facts.tier:
        return False
    if match.key_id is not None and match.key_id != facts.key_id:
        return False
    if match.model is not None and match.model != facts.model:
        return False
    if match.header is not None and facts.headers.get(match.header.name) != match.header.value:
        return False
    return all(facts.metadata.get(k) == v for k, v in match.metadata.items())


def first_match(rules: Sequence[PolicyRule], facts: RequestFacts) -> PolicyRule | None:
    """The first rule, in order, whose match holds; None when none does."""
    for rule in rules:
        if matches(rule.match, facts):
            return rule
    return None
