"""Whether Kubernetes NetworkPolicies let one pod reach another on a port, as the API defines it: a pod
selected by no policy of a direction is open in it; a selected one takes only what some rule of a
selecting policy allows, and a connection needs both the source's egress and the destination's ingress."""

from dataclasses import dataclass, field

EXTERNAL = "<outside the cluster>"


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str  # EXTERNAL for an address outside the cluster
    labels: dict[str, str] = field(default_factory=dict)

    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against ``labels``; {} selects everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, policy_namespace: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        return pod.namespace == EXTERNAL  # the pods' own addresses are never listed here
    if pod.namespace == EXTERNAL:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], pod.namespace_labels())
    else:
        in_namespace = pod.namespace == policy_namespace
    return in_namespace and selects(peer.get("podSelector", {}), pod.labels)


def port_matches(rule: dict, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    return not ports or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports)


def allows(policies: list[dict], direction: str, subject: Pod, other: Pod, port: int, protocol: str) -> bool:
    """Whether ``subject``'s policies of ``direction`` (Ingress or Egress) let ``other`` through on ``port``."""
    if subject.namespace == EXTERNAL:
        return True
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], subject.labels)
    ]
    if not selecting:
        return True
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in selecting:
        for rule in policy["spec"].get(key, []):
            matched = not rule.get(peers) or any(
                peer_matches(peer, policy["metadata"]["namespace"], other) for peer in rule[peers]
            )
            if matched and port_matches(rule, port, protocol):
                return True
    return False


def reachable(policies: list[dict], source: Pod, destination: Pod, port: int, protocol: str = "TCP") -> bool:
    return allows(policies, "Egress", source, destination, port, protocol) and allows(
        policies, "Ingress", destination, source, port, protocol
    )
