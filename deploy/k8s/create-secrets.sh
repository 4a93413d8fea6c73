#!/bin/sh
# Creates the Secrets deploy/k8s reads, one per consumer (lorafleet-nats, lorafleet-redis,
# lorafleet-<service>, lorafleet-admin, lorafleet-worker-<id>), from passwords kept in DIR
# (default ./k8s-secrets; keep it out of git and images, it is the only copy besides the cluster):
#   deploy/k8s/create-secrets.sh [DIR]        (re-run: kept passwords, Secrets replaced in place)
# Workers 1 and 2 are deploy/k8s/base/workers.yaml's; the routes name the StatefulSet's pods.
# lorafleet-prometheus holds the /metrics bearer token for your Prometheus (docs/operations.md).
# NATS speaks TLS only: DIR/nats-tls holds its certificate (tls.crt, tls.key) and CA (ca.crt), made by
# deploy/k8s/make-nats-certs.sh DIR/nats-tls or brought by the operator; they become lorafleet-nats-tls
# (the nodes') and lorafleet-nats-ca (ca.crt alone, what every client verifies the nodes with).
set -eu
dir=${1:-k8s-secrets}
namespace=${LF_NAMESPACE:-lorafleet}
for file in tls.crt tls.key ca.crt; do
  if [ ! -f "$dir/nats-tls/$file" ]; then
    echo "no $dir/nats-tls/$file: run deploy/k8s/make-nats-certs.sh $dir/nats-tls first (docs/operations.md)" >&2
    exit 1
  fi
done
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
kubectl -n "$namespace" create secret generic lorafleet-nats-tls --from-file=tls.crt="$dir/nats-tls/tls.crt" \
  --from-file=tls.key="$dir/nats-tls/tls.key" --from-file=ca.crt="$dir/nats-tls/ca.crt" \
  --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$namespace" create secret generic lorafleet-nats-ca --from-file=ca.crt="$dir/nats-tls/ca.crt" \
  --dry-run=client -o yaml | kubectl apply -f -
