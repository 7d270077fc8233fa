#!/usr/bin/env bash
# One node's daemon of a multi-node job (train-with-job-daemons.sbatch runs it on every node
# with srun). The job's ranks on this node use the Unix socket ASTERIA_ADDRESS; the daemons of
# the job's nodes reach each other on the peer listener, TCP with mutual TLS, with the
# certificates that deploy/tls/make-cluster-certs.sh made (ca.crt and NODE.crt/NODE.key in
# ASTERIA_TLS_DIR, NODE being this node's short host name).
#
#   ASTERIA_ADDRESS      unix:// socket of this node's ranks (required)
#   ASTERIA_WORKERS      solver processes (default 16)
#   ASTERIA_TLS_DIR      the certificates (default /etc/asteria/tls)
#   ASTERIA_PEER_LISTEN  where peers connect (default 0.0.0.0:29600; the daemon advertises this
#                        host's name with the port: set ASTERIA_PEER_ADVERTISE=HOST:PORT for
#                        another address, e.g. the node's fabric interface)
#   ASTERIA_NODE_CERT    the certificate's name in ASTERIA_TLS_DIR (default: hostname -s)
#   ASTERIA_TOKENS       the job's tenant token (tenant=token): peers present it
set -euo pipefail

: "${ASTERIA_ADDRESS:?set ASTERIA_ADDRESS to the unix:// socket of this node}"
: "${ASTERIA_TOKENS:?set ASTERIA_TOKENS (tenant=token) for the peer listener}"
workers=${ASTERIA_WORKERS:-16}
tls_dir=${ASTERIA_TLS_DIR:-/etc/asteria/tls}
peer_listen=${ASTERIA_PEER_LISTEN:-0.0.0.0:29600}
node=${ASTERIA_NODE_CERT:-$(hostname -s)}

# exec: srun's SIGTERM reaches the daemon itself, which drains and stops its workers.
exec asteria-server --listen "${ASTERIA_ADDRESS}" --workers "${workers}" --log-format json \
    --peer-listen "${peer_listen}" --peer-tls-ca "${tls_dir}/ca.crt" \
    --peer-tls-cert "${tls_dir}/${node}.crt" --peer-tls-key "${tls_dir}/${node}.key"
