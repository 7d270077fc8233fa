#!/usr/bin/env bash
# Make a self-signed CA and one certificate per node for the daemons' peer listener
# (peer_listen, mutual TLS: every daemon shows its node's certificate and checks its peer's
# against the CA).
#
#   make-cluster-certs.sh OUT_DIR NODE [NODE...]
#
# Writes, in OUT_DIR (created 0700; keys 0600):
#   ca.crt ca.key         the cluster's CA (keep ca.key off the nodes: it signs new members)
#   NODE.crt NODE.key     one pair per node, signed by the CA
#
# Every node certificate carries the name asteria-peer (the daemon's peer_tls_server_name, so
# one name covers every node whatever its address), DNS:NODE (or IP:NODE for an address), and
# the names in ASTERIA_CERT_EXTRA_SANS (e.g. "DNS:localhost,IP:127.0.0.1"). Valid for
# ASTERIA_CERT_DAYS days (default 365). An existing ca.crt/ca.key in OUT_DIR is reused, so
# running it again for a new node keeps the others valid.
#
# Kubernetes: kubectl -n asteria create secret generic asteria-peer-tls \
#     --from-file=ca.crt=OUT_DIR/ca.crt --from-file=tls.crt=OUT_DIR/NODE.crt \
#     --from-file=tls.key=OUT_DIR/NODE.key   (one node certificate may serve every node: the
#     peers check the name asteria-peer, not the address).
# Slurm: copy ca.crt and the node's pair to /etc/asteria/tls/ on each node (owner: the
#     daemon's user, keys 0600).
set -euo pipefail

usage="usage: make-cluster-certs.sh OUT_DIR NODE [NODE...]"
out=${1:?$usage}
shift
if (($# == 0)); then
    echo "$usage" >&2
    exit 2
fi
days=${ASTERIA_CERT_DAYS:-365}
extra=${ASTERIA_CERT_EXTRA_SANS:-}
server_name=${ASTERIA_PEER_SERVER_NAME:-asteria-peer}

umask 077
mkdir -p "$out"
chmod 0700 "$out"

if [[ ! -s "$out/ca.crt" || ! -s "$out/ca.key" ]]; then
    openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
        -keyout "$out/ca.key" -out "$out/ca.crt" -days "$days" -sha256 \
        -subj "/O=asteria/CN=asteria cluster CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    echo "make-cluster-certs: new CA $out/ca.crt"
fi

for node in "$@"; do
    if [[ ! $node =~ ^[A-Za-z0-9._:-]+$ ]]; then
        echo "make-cluster-certs: $node is not a host name or an address" >&2
        exit 2
    fi
    if [[ $node =~ ^[0-9.]+$ || $node == *:* ]]; then
        own="IP:$node"
    else
        own="DNS:$node"
    fi
    sans="DNS:$server_name,$own${extra:+,$extra}"
    ext="$out/.$node.ext"
    printf '%s\n' \
        "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature,keyEncipherment" \
        "extendedKeyUsage=serverAuth,clientAuth" \
        "subjectAltName=$sans" >"$ext"
    openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
        -keyout "$out/$node.key" -out "$out/.$node.csr" \
        -subj "/O=asteria/CN=$node" 2>/dev/null
    openssl x509 -req -in "$out/.$node.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
        -CAcreateserial -out "$out/$node.crt" -days "$days" -sha256 -extfile "$ext" 2>/dev/null
    rm -f "$out/.$node.csr" "$ext"
    openssl verify -CAfile "$out/ca.crt" "$out/$node.crt" >/dev/null
    echo "make-cluster-certs: $out/$node.crt ($sans)"
done
rm -f "$out/ca.srl"
