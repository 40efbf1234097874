# Sourced by the scripts of this folder (not run on its own): moves to the repository root, checks the virtual
# environment that setup.sh made, and on a Cloud TPU pod slice exports the host list with which
# `configs.sharding.initialize_distributed` (called first thing by every entry point) joins the hosts.
#
# TPU_WORKER_HOSTNAMES / TPU_WORKER_ID: GKE sets them; on a TPU VM they are read here from the VM's metadata server
# (`worker-network-endpoints`, `agent-worker-number`). With one host nothing is joined: the job is single-process.

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ ! -x .venv/bin/python ]; then
  echo "error: no .venv in $(pwd); run scripts/tpu_vm/setup.sh first (on every host of a pod slice)" >&2
  exit 2
fi
PY=.venv/bin/python

_tpu_metadata() {
  curl -sf -m 5 -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}

if [ -z "${TPU_WORKER_HOSTNAMES:-}" ] && endpoints=$(_tpu_metadata worker-network-endpoints); then
  # Entries are hostnames or name:id:address triples; the last field addresses the host either way.
  TPU_WORKER_HOSTNAMES=$(tr ',' '\n' <<<"$endpoints" | awk -F: 'NF {print $NF}' | paste -sd, -)
  TPU_WORKER_ID=$(_tpu_metadata agent-worker-number)
  export TPU_WORKER_HOSTNAMES TPU_WORKER_ID
fi

# Hosts in this job (1 on a single TPU VM or off Cloud TPU).
tpu_hosts() {
  local n
  n=$(tr ',' '\n' <<<"${TPU_WORKER_HOSTNAMES:-}" | grep -c . || true)
  echo $((n > 0 ? n : 1))
}
