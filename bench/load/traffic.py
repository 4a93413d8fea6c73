"""The open-loop schedule: Poisson arrivals, zipf adapter popularity, tenants; seeded and pure."""

import random
from dataclasses import dataclass
from itertools import accumulate

TOPICS = (
    "the tides",
    "a lighthouse keeper",
    "sourdough bread",
    "prime numbers",
    "a mountain railway",
    "honeybees",
    "the northern lights",
    "a city library",
    "glaciers",
    "paper money",
    "the printing press",
    "an old harbour",
    "solar panels",
    "a chess opening",
    "migrating geese",
    "a night market",
)
ASKS = (
    "Explain {topic} to a curious twelve-year-old in a short paragraph, with one surprising fact.",
    (
        "Write a brief, friendly note to a colleague describing {topic} and why someone might find it "
        "interesting on a quiet Sunday afternoon."
    ),
    (
        "List three things most people get wrong about {topic}, then correct each one in a single plain "
        "sentence that a busy reader could remember the next day."
    ),
    "Describe {topic} as a travel guide would.",
)


@dataclass(frozen=True, slots=True)
class Population:
    """What traffic may ask for: the base model, and each adapter with the tenant that owns it."""

    base_model: str
    tenants: tuple[str, ...]
    adapters: tuple[tuple[str, str], ...]  # (adapter id, owner tenant)


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at_s: float  # offset from the start of the run
    tenant: str
    model: str  # an adapter id, or the base model
    prompt: str
    priority: str | None = None  # the SLO class asked for (x-lorafleet-priority); None = the tenant's tier


def poisson_times(rate: float, count: int, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process of ``rate``/s: at most ``count``, all before ``duration_s``."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    times: list[float] = []
    t = rng.expovariate(rate)
    while len(times) < count and t < duration_s:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def zipf_weights(n: int, s: float) -> list[float]:
    """P(popularity rank k) proportional to 1 / k**s, k = 1..n, normalised."""
    raw = [1.0 / k**s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def popularity_order(adapters: tuple[tuple[str, str], ...], seed: int) -> list[tuple[str, str]]:
    """Adapters from most to least popular: a seeded shuffle, so popularity is independent of id, rank and owner."""
    order = list(adapters)
    random.Random(f"popularity-{seed}").shuffle(order)
    return order


def prompt(rng: random.Random) -> str:
    """A chat prompt of roughly 20-60 tokens."""
    return rng.choice(ASKS).format(topic=rng.choice(TOPICS))


def parse_slo_mix(text: str) -> dict[str, float]:
    """``interactive:1,standard:2,batch:1`` -> class -> weight ('' = no classes asked for)."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in ("interactive", "standard", "batch") or not weight:
            raise ValueError(f"bad SLO mix entry {part!r}: want interactive|standard|batch:<weight>")
        mix[name] = float(weight)
        if mix[name] < 0:
            raise ValueError(f"bad SLO mix weight {part!r}")
    if mix and sum(mix.values()) <= 0:
        raise ValueError("an SLO mix needs a positive weight")
    return mix


def schedule(
    population: Population,
    *,
    rate: float,
    count: int,
    duration_s: float,
    zipf_s: float,
    base_share: float,
    seed: int,
    slo_mix: dict[str, float] | None = None,
) -> list[Arrival]:
    """Every request of a run, in time order.

    A request asks for the base model with probability ``base_share`` (its tenant uniform), else for an
    adapter drawn zipf(``zipf_s``) over all adapters, sent by the adapter's owner. With ``slo_mix`` each
    asks for an SLO class drawn by weight, from its own seeded stream: the models and times stay those
    of the same seed without a mix."""
    rng = random.Random(seed)
    classes = random.Random(f"slo-{seed}")
    times = poisson_times(rate, count, duration_s, rng)
    ranked = popularity_order(population.adapters, seed)
    cumulative = list(accumulate(zipf_weights(len(ranked), zipf_s))) if ranked else []
    arrivals = []
    for index, at_s in enumerate(times):
        if not ranked or rng.random() < base_share:
            tenant, model = rng.choice(population.tenants), population.base_model
        else:
            model, tenant = rng.choices(ranked, cum_weights=cumulative)[0]
        priority = classes.choices(list(slo_mix), weights=list(slo_mix.values()))[0] if slo_mix else None
        arrivals.append(Arrival(index, at_s, tenant, model, prompt(rng), priority))
    return arrivals
