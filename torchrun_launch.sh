#!/usr/bin/env bash
# Train on this node: NGPU processes, each running `python -m trainer.train`, started by
# `python -m trainer.launch` through torch's elastic agent (what torchrun --standalone does).
#
#   ./torchrun_launch.sh [--job.config_file FILE] [--section.key VALUE ...]
#
# A failing rank ends the run with one message on stderr, `error: ...` (the rank that failed
# first, its exit code or signal) then `full logs: <job.dump_folder>/logs/<time>`, and exit code
# 2 for a user's mistake, 128+N for signal N, else the rank's exit code (docs/training.md).
#
# Environment:
#   NGPU         processes to start (default: visible GPUs; on a CPU-only machine 2, enough for FSDP)
#   CONFIG_FILE  config used when no --job.config_file is given (default debug_model.toml)
#   LOG_RANK     rank(s) whose output is shown, comma separated (default 0)
#   MAX_RESTARTS automatic restarts after a rank fails, each from the latest checkpoint (default
#                auto: 3 when the run saves checkpoints, checkpoint.enable without load_only, else 0,
#                as a restart without checkpoints would train again from step 0); never after a
#                user's mistake (exit 2). The ranks die with the launcher, and a second job refuses a
#                dump folder that a live job holds (<dump_folder>/.lock).
#   PYTHON       interpreter (default: the active virtualenv, else ./.venv next to this script, else python3)
#   PYTORCH_CUDA_ALLOC_CONF  the CUDA allocator's settings (default expandable_segments:True, which
#                reserved 2.7 GiB less for the same 1B step on one H100: docs/performance.md)
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
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

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
MAX_RESTARTS="${MAX_RESTARTS:-auto}"
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NGPU: '$NGPU' is not a number of processes; give a positive integer (or leave NGPU unset)" >&2
  exit 2
fi
if ! [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "error: LOG_RANK: '$LOG_RANK' is not a rank or a comma-separated list of ranks (e.g. 0 or 0,1)" >&2
  exit 2
fi
if ! [[ "$MAX_RESTARTS" =~ ^(auto|[0-9]+)$ ]]; then
  echo "error: MAX_RESTARTS: '$MAX_RESTARTS' is not 'auto' or a number of restarts (e.g. 0 or 3)" >&2
  exit 2
fi
ARGS=(--job.config_file "${CONFIG_FILE:-debug_model.toml}" "$@")

# Help and config printing need no process group: one process answers them.
for arg in "$@"; do
  case "$arg" in
    -h|--help|--job.print_config|--job.print_config=true)
      exec "$PYTHON" -m trainer.train "${ARGS[@]}" ;;
  esac
done

# The launcher checks the configuration against the world size once (trainer/preflight/checks.py), then
# starts the processes; the seed checkpoint (--checkpoint.create_seed_checkpoint) is one process.
exec "$PYTHON" -m trainer.launch --nproc "$NGPU" --device "$DEVICE" --log-ranks "$LOG_RANK" \
  --max-restarts "$MAX_RESTARTS" "${ARGS[@]}"
