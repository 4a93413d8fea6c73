#!/bin/sh
# Creates the Secrets deploy/k8s reads, one per consumer (lorafleet-nats, lorafleet-redis,
# lorafleet-<service>, lorafleet-admin, lorafleet-worker-<id>), from passwords kept in DIR
# (default ./k8s-secrets; keep it out of git and images, it is the only copy besides the cluster):
#   deploy/k8s/create-secrets.sh [DIR]        (re-run: kept passwords, Secrets replaced in place)
# Workers 1 and 2 are deploy/k8s/base/workers.yaml's; the routes name the StatefulSet's pods.
set -eu
dir=${1:-k8s-secrets}
namespace=${LF_NAMESPACE:-lorafleet}
for consumer in state nats redis prometheus gateway registry scheduler auditor admin worker-1 worker-2; do
  mkdir -p "$dir/$consumer"
done
chmod 700 "$dir"
python -m lorafleet.cli.compose_init --root "$dir" --workers 1,2 --nats-cluster nats-0.nats-headless,nats-1.nats-headless,nats-2.nats-headless
kubectl get namespace "$namespace" >/dev/null 2>&1 || kubectl create namespace "$namespace"
for consumer in nats redis prometheus gateway registry scheduler auditor admin worker-1 worker-2; do
  kubectl -n "$namespace" create secret generic "lorafleet-$consumer" --from-file="$dir/$consumer" \
    --dry-run=client -o yaml | kubectl apply -f -
done
