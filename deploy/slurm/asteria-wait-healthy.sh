#!/usr/bin/env bash
# Wait until the asteria-server at ADDRESS answers SERVING on its health service.
#   asteria-wait-healthy.sh ADDRESS [TIMEOUT_S]
# Exit 0 once healthy, 1 when it is not within TIMEOUT_S (default 120): the daemon's workers
# start and calibrate in a few seconds, more on a loaded node.
set -euo pipefail

address=${1:?usage: asteria-wait-healthy.sh ADDRESS [TIMEOUT_S]}
timeout_s=${2:-120}
deadline=$((SECONDS + timeout_s))

until asteria-server --listen "$address" --health-check --health-timeout-s 2 >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
        echo "asteria-wait-healthy: no healthy daemon at $address on $(hostname) after ${timeout_s} s" >&2
        exit 1
    fi
    sleep 1
done
echo "asteria-wait-healthy: daemon at $address on $(hostname) is serving"
