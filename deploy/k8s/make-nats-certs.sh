#!/bin/sh
# A private CA and the NATS servers' certificate for deploy/k8s (docs/operations.md, "NATS TLS"):
#   deploy/k8s/make-nats-certs.sh DIR     (default ./k8s-secrets/nats-tls, where create-secrets.sh looks)
# writes DIR/ca.crt and DIR/ca.key (the CA: keep its key offline), DIR/tls.crt and DIR/tls.key (the nodes'
# certificate, for clients and routes: every name the clients and the routes dial, server and client use).
# Re-run to renew the certificate under the same CA; delete DIR/ca.key first to make a new CA too.
set -eu
dir=${1:-k8s-secrets/nats-tls}
namespace=${LF_NAMESPACE:-lorafleet}
nodes=${LF_NATS_NODES:-3}  # deploy/k8s/base/nats.yaml's replicas
days=${LF_CERT_DAYS:-825}
umask 077
mkdir -p "$dir"
if [ ! -f "$dir/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -subj "/CN=lorafleet NATS CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
fi
# localhost: the admin CLI through `kubectl port-forward svc/nats 4222` (docs/operations.md); the CA is
# trusted by lorafleet's clients alone
sans="DNS:localhost,DNS:nats,DNS:nats.$namespace,DNS:nats.$namespace.svc,DNS:nats.$namespace.svc.cluster.local"
i=0
while [ "$i" -lt "$nodes" ]; do
  for suffix in "" ".$namespace" ".$namespace.svc" ".$namespace.svc.cluster.local"; do
    sans="$sans,DNS:nats-$i.nats-headless$suffix"
  done
  i=$((i + 1))
done
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
  -keyout "$dir/tls.key" -out "$dir/tls.csr" -subj "/CN=nats.$namespace.svc"
printf '%s\n' "subjectAltName=$sans" "extendedKeyUsage=serverAuth,clientAuth" \
  "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyAgreement" > "$dir/tls.ext"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days "$days" \
  -out "$dir/tls.crt" -extfile "$dir/tls.ext"
rm -f "$dir/tls.csr" "$dir/tls.ext" "$dir/ca.srl"
chmod 644 "$dir/ca.crt" "$dir/tls.crt"
