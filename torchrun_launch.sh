#!/usr/bin/env bash
# Train on this node: NGPU processes through torchrun, each running `python -m trainer.train`.
#
#   ./torchrun_launch.sh [--job.config_file FILE] [--section.key VALUE ...]
#
# Environment:
#   NGPU         processes to start (default: visible GPUs; on a CPU-only machine 2, enough for FSDP)
#   CONFIG_FILE  config used when no --job.config_file is given (default debug_model.toml)
#   LOG_RANK     rank(s) whose output is shown, comma separated (default 0)
#   PYTHON       interpreter (default: the active virtualenv, else ./.venv next to this script, else python3)
# Works from any directory; a bare config name is looked up there first, then in train_configs/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON=python
  elif [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"
  else PYTHON=python3
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

count_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # set, even empty (= no GPU), it decides
    tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}
GPUS=$(count_gpus)
DEVICE=cuda
[ "$GPUS" -gt 0 ] || DEVICE=cpu
if [ -z "${NGPU:-}" ]; then
  NGPU=$GPUS
  [ "$NGPU" -gt 0 ] || NGPU=2
fi
LOG_RANK="${LOG_RANK:-0}"
ARGS=(--job.config_file "${CONFIG_FILE:-debug_model.toml}" "$@")

# Help, config printing and the seed checkpoint need no process group: one process answers them
# (the seed checkpoint must come from exactly one process, whatever NGPU and the degrees say).
for arg in "$@"; do
  case "$arg" in
    -h|--help|--job.print_config|--job.print_config=true|--checkpoint.create_seed_checkpoint|--checkpoint.create_seed_checkpoint=true)
      exec "$PYTHON" -m trainer.train "${ARGS[@]}" ;;
  esac
done

# Check the configuration against the world size once, before starting NGPU processes.
"$PYTHON" -m trainer.preflight --nproc "$NGPU" --device "$DEVICE" "${ARGS[@]}"

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m trainer.train "${ARGS[@]}"
