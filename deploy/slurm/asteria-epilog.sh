#!/usr/bin/env bash
# Slurm Epilog: forget a finished job's blocks and results on the node's shared daemon (the
# systemd asteria-server that train-with-node-daemon.sbatch uses), so a finished job frees its
# memory at once instead of after the daemon's job_ttl_s. Install it on every node and name it
# in slurm.conf (Epilog=/etc/slurm/asteria-epilog.sh), or call it from the epilog you have.
#
# slurmd runs it as root with SLURM_JOB_ID and SLURM_JOB_USER set. The job is the ASTERIA_JOB
# the batch script set: "${SLURM_JOB_NAME}-${SLURM_JOB_ID}"; the tenant is the job's user, whose
# token it reads from the daemon's tokens file (ASTERIA_TOKENS="tenant=token,...").
#
# It never fails the node (a failing Epilog drains it): whatever happens it exits 0 and says
# why in syslog (tag asteria-epilog); the daemon's expiry frees what it could not.
#
# Settings (environment, for a site wrapper or tests):
#   ASTERIA_ADDRESS      the daemon (default unix:///run/asteria/asteria.sock)
#   ASTERIA_TOKENS_FILE  the daemon's tokens file (default /etc/asteria/tokens.env)
#   ASTERIA_DAEMON_USER  the user the daemon runs as (default asteria), trusted by the client
#   ASTERIA_CLI          the asteria command (default: asteria on PATH)
set -uo pipefail
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:${PATH}}

address=${ASTERIA_ADDRESS:-unix:///run/asteria/asteria.sock}
tokens_file=${ASTERIA_TOKENS_FILE:-/etc/asteria/tokens.env}
daemon_user=${ASTERIA_DAEMON_USER:-asteria}
cli=${ASTERIA_CLI:-asteria}

say() {
    logger -t asteria-epilog -- "$*" 2>/dev/null || true
    echo "asteria-epilog: $*" >&2
}

job_id=${SLURM_JOB_ID:-}
user=${SLURM_JOB_USER:-}
if [[ -z ${job_id} || -z ${user} ]]; then
    say "SLURM_JOB_ID or SLURM_JOB_USER is not set: not run by slurmd, nothing to do"
    exit 0
fi

name=${SLURM_JOB_NAME:-}
if [[ -z ${name} ]] && command -v scontrol >/dev/null 2>&1; then
    name=$(scontrol show job "${job_id}" --oneliner 2>/dev/null |
        sed -n 's/.*JobName=\([^ ]*\).*/\1/p')
fi
if [[ -z ${name} ]]; then
    say "job ${job_id}: its name is unknown; its blocks expire after the daemon's job_ttl_s"
    exit 0
fi
job="${name}-${job_id}"

token=""
if [[ -r ${tokens_file} ]]; then
    tokens=$(sed -n 's/^[[:space:]]*ASTERIA_TOKENS=//p' "${tokens_file}" | tail -n 1)
    tokens=${tokens//\"/}
    tokens=${tokens//\'/}
    IFS=',' read -r -a entries <<<"${tokens}"
    for entry in "${entries[@]}"; do
        entry=${entry//[[:space:]]/}
        if [[ ${entry%%=*} == "${user}" ]]; then
            token=${entry#*=}
        fi
    done
fi
if [[ -z ${token} ]]; then
    say "job ${job}: no token for tenant ${user} in ${tokens_file}; its blocks expire later"
    exit 0
fi

daemon_uid=$(id -u "${daemon_user}" 2>/dev/null || true)
export ASTERIA_TOKEN=${token}
if [[ -n ${daemon_uid} ]]; then
    export ASTERIA_DAEMON_UID=${daemon_uid}
fi
if output=$(timeout 60 "${cli}" forget --job "${job}" --tenant "${user}" \
    --address "${address}" --if-running --timeout-s 10 2>&1); then
    say "${output}"
else
    say "job ${job}: asteria forget failed: ${output}"
fi
exit 0
