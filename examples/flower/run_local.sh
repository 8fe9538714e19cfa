#!/usr/bin/env bash
# A Flower federation on this machine, over loopback: one SuperLink, N SuperNodes
# (one fedloom client each), then `flwr run` of the app in this folder.
#
#   examples/flower/run_local.sh [N] [--run-config 'overrides="rounds=2"']
#
# Needs fedloom installed with the [flower] and [data] extras in the active
# environment (make run / make test create .venv with them). Logs go to
# $WORK (default: a new temporary folder); every process is stopped at the end.
#
# ISOLATION=subprocess (default): each SuperNode starts its own SuperExec.
# ISOLATION=process: the SuperNodes start none; this script starts one
#   `flower-superexec` per SuperNode itself (as a separate container would).
# Either way the SuperExec starts a fresh `flwr-clientapp` process per message.
# FLWR_SUPEREXEC_TASK_POLL_INTERVAL (Flower's environment variable, default 1 s):
# how often a SuperExec asks its SuperNode for a message to run; set it to try a
# shorter wait (docs/deploy.md, "Round time", has what it changed here).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
N="${1:-4}"; shift || true
PORT="${FLOWER_PORT:-9093}"
ISOLATION="${ISOLATION:-subprocess}"
WORK="${WORK:-$(mktemp -d)}"
export FLWR_HOME="$WORK/flwr-home"
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local-deployment"

[superlink.local-deployment]
address = "127.0.0.1:$PORT"
insecure = true
TOML
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
# --insecure: no TLS, no node authentication (loopback only; see docs/deploy.md).
flower-superlink --insecure --host 127.0.0.1 --port "$PORT" \
  --disable-runtime-dependency-installation --database :flwr-in-memory: \
  > "$WORK/superlink.log" 2>&1 &
PIDS+=($!)
# wait until the SuperLink accepts connections (at most 300 s: a loaded machine)
for ((i = 0; ; i++)); do
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  if ((i >= 600)); then
    echo "run_local.sh: the SuperLink did not accept connections on port $PORT within 300 s;" \
      "its log: $WORK/superlink.log" >&2
    exit 1
  fi
  sleep 0.5
done
# The N SuperNodes share this machine's cores: each trains with nproc / N torch
# threads (at least 1) unless OMP_NUM_THREADS is set. More threads than cores make
# PyTorch's OpenMP workers spin against each other (docs/deploy.md, "Round time").
NODE_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))}"
for ((k = 0; k < N; k++)); do
  OMP_NUM_THREADS="$NODE_THREADS" flower-supernode --insecure --superlink "127.0.0.1:$PORT" --port $((PORT + 100 + k)) \
    --isolation "$ISOLATION" --node-config "partition-id=$k" > "$WORK/supernode-$k.log" 2>&1 &
  PIDS+=($!)
  if [[ "$ISOLATION" == process ]]; then
    OMP_NUM_THREADS="$NODE_THREADS" flower-superexec --insecure --runtime-api-address "127.0.0.1:$((PORT + 100 + k))" \
      > "$WORK/superexec-$k.log" 2>&1 &
    PIDS+=($!)
  fi
done
# the ServerApp waits for all N SuperNodes before round 1 (FedloomStrategy.node_timeout)
# APP: another Flower App folder to run on the same federation (benchmarks/deploy.py)
flwr run "${APP:-$HERE}" local-deployment --stream "$@" | tee "$WORK/run.log"
