#!/usr/bin/env bash
# The GPU checks of this project in one command, for a machine with one NVIDIA GPU:
#
#   bash benchmarks/gpu_suite.sh          (from the repository root; about 19 minutes in all)
#   GPU_SUITE_PARTS="side_by_side_1b cuda_tests" bash benchmarks/gpu_suite.sh   (those parts, in that order)
#
# First it installs the wheels carried in .whl/ (packages the machine lacks) into /tmp/site, if any,
# and prints the machine: nvidia-smi, torch, CUDA, cuDNN, NCCL, Triton, package versions; it
# imports every trainer module and times a bf16 matmul (what the GPU sustains, beside the MFU
# peak). Then the parts (docs/performance.md, "On a GPU"):
#   cuda_tests           tests/cuda with TRAINER_TEST_DEVICE=cuda (pytest-xdist when present)
#   side_by_side_1b      benchmarks/side_by_side.py: this trainer, torchtitan and a plain loop on
#                        the 1B shape (torchtitan's wheels in .whl/: see that script)
#   side_by_side_8b      the same on the 8B flavor cut to 8 layers
#   ring_kernels         benchmarks/ring_kernels.py: one CP rank's ring attention kernels against
#                        whole-sequence flash attention (time, peak memory)
#   document_masking     benchmarks/document_masking.py (its runs train on the GPU)
#   protocol_techniques  protocol/plans/gpu_techniques.toml in statistical mode
#   estimate_1b          optional: the memory estimator against the CUDA allocator's peak of a
#                        real 1B run (benchmarks/estimate_vs_device.py)
#   bench_1b             optional: the 1B flavor (tied), bf16, compile, 30 steps: tokens/s,
#                        TFLOPS, MFU and memory from its metrics.jsonl
#   bench_1b_eager       optional: the same without compile (compile's speed-up)
#   profile_1b           optional: benchmarks/profile_step.py on the side-by-side 1B case: ms per
#                        phase, the kernels with the most device time, a Chrome trace
#   offload_1b           optional: benchmarks/strategies.py, 1B on one GPU: FSDP with and without
#                        CPU offload (time per step, peak memory)
#   float8_8b            optional: benchmarks/side_by_side.py on the 8B flavor cut to 8 layers, compiled,
#                        bf16 against float8 tensorwise and rowwise linear layers, this trainer and
#                        torchtitan (float8's speed-up, and this trainer's float8 against torchtitan's)
#   protocol_float8      optional: protocol/plans/float8_gpu.toml in statistical mode (float8
#                        tensorwise and rowwise must pass against bf16, a 5% higher lr must fail)
#   cp_documents         optional: benchmarks/cp_document_memory.py --device cuda at 32k tokens: one CP
#                        rank's ring attention with documents, peak memory against cp (tiled masked
#                        pairs against whole ones)
#
# Each part runs under a time limit, with every process it started ended at the limit; a part
# that fails or times out is recorded and the suite goes on. The whole suite keeps within
# GPU_SUITE_BUDGET_S seconds (default 1200); a required part keeps its limit even when an earlier
# one runs long, an optional one runs on what is left. Results go to ${OUT:-outputs/gpu_suite},
# at most 8 files: summary.md (every table and the status of each part, also printed at the end),
# suite.log, cuda_tests.log, cuda_tests.xml, bench_1b.log, document_masking.log and
# details.tar.gz (the runs' logs, metrics and records; checkpoints left out).
#
# Environment: PYTHON (default .venv/bin/python when it exists, else python3), OUT, GPU_SUITE_BUDGET_S,
# GPU_SUITE_PARTS, GPU_SUITE_XDIST_WORKERS (default 6), a GPU_SUITE_*_S limit per part (below).
# GPU_SUITE_CPU_SMOKE=1 checks the script itself on a machine without a GPU: everything on the CPU,
# tests/cuda/test_in_process.py only (TRAINER_TEST_DEVICE=cpu), the debug model in place of 1B,
# the side-by-side dry runs, the technique plan expanded but not run; limits three times longer.
set -uo pipefail  # no -e: a part that fails is reported and the next one runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
START=$(date +%s)
BUDGET=${GPU_SUITE_BUDGET_S:-1200}
OUT_DIR="${OUT:-$ROOT/outputs/gpu_suite}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
WORK="$(mktemp -d /tmp/gpu_suite.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT  # what is worth keeping is copied to $OUT_DIR (details.tar.gz)
# The project's environment when there is one (.venv, from `make setup`), else the machine's python3
# (a GPU machine with torch preinstalled).
DEFAULT_PYTHON=python3
[ -x "$ROOT/.venv/bin/python" ] && DEFAULT_PYTHON="$ROOT/.venv/bin/python"
export PYTHON="${PYTHON:-$DEFAULT_PYTHON}"
export PYTHONUNBUFFERED=1 GPU_SUITE_WORK="$WORK"
exec > >(tee -a "$OUT_DIR/suite.log") 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET - $(elapsed) )); }
say() { echo "[gpu_suite +$(elapsed)s] $*"; }

say "repository $ROOT; results in $OUT_DIR; scratch $WORK; budget ${BUDGET}s"

# --- 0. carried wheels ------------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing $(ls .whl/*.whl | wc -l) carried wheel(s) into /tmp/site: $(cd .whl && ls *.whl | tr '\n' ' ')"
  if timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    say "WARNING: installing the wheels failed; going on without them"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --- helpers: the part runner and the summary, small Python programs -----------------------------
cat >"$WORK/run_part.py" <<'PY'
"""run_part.py NAME LIMIT_S LOG STATUS_FILE -- COMMAND...: run COMMAND with its output in LOG.
At LIMIT_S, every process it started (found through /proc, also those in their own sessions,
such as the launcher's ranks) gets SIGTERM, then SIGKILL 10 s later; processes left behind by a
command that ended are ended too. While it runs, nvidia-smi samples GPU use once a second.
Appends one line to STATUS_FILE: name, exit code, status, seconds, limit, max GPU %, max MiB
(the samples stay in $GPU_SUITE_WORK/NAME.gpu.csv)."""
import os, shutil, signal, subprocess, sys, time

name, limit, log, status_file = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
command = sys.argv[sys.argv.index("--") + 1:]


def table():
    parents, starts = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parents[int(entry)], starts[int(entry)] = int(fields[1]), fields[19]
            except (OSError, IndexError, ValueError):
                pass
    return parents, starts


def descendants(root, parents):
    children = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(known):
    _, starts = table()
    return {pid: start for pid, start in known.items() if starts.get(pid) == start}


def end(known, proc):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [proc.pid, *alive(known)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and (proc.poll() is None or alive(known)):
            time.sleep(0.2)
        if proc.poll() is not None and not alive(known):
            return


began = time.time()
sampler, samples = None, os.path.join(os.environ.get("GPU_SUITE_WORK", "/tmp"), name + ".gpu.csv")
if shutil.which("nvidia-smi"):
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                "-l", "1"], stdout=open(samples, "w"), stderr=subprocess.DEVNULL)
with open(log, "w") as out:
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    known, timed_out = {}, False
    while proc.poll() is None:
        parents, starts = table()
        known.update({pid: starts[pid] for pid in descendants(proc.pid, parents) if pid in starts})
        if time.time() - began > limit:
            timed_out = True
            out.write(f"\n[run_part] {name}: time limit {limit:.0f} s reached; ending its processes\n")
            out.flush()
            end(known, proc)
            break
        time.sleep(0.5)
    leftover = alive(known)
    if leftover and not timed_out:
        out.write(f"\n[run_part] {name}: ending processes it left running: {sorted(leftover)}\n")
        end(leftover, proc)
seconds = time.time() - began
if sampler:
    sampler.terminate()
    sampler.wait()
util = mem = ""
try:
    rows = [line.split(",") for line in open(samples) if line.count(",") == 1]
    util = max(int(r[0]) for r in rows if r[0].strip().isdigit())
    mem = max(int(r[1]) for r in rows if r[1].strip().isdigit())
except (OSError, ValueError):
    pass
code = 124 if timed_out else proc.returncode
state = "TIMED OUT" if timed_out else ("ok" if code == 0 else f"FAILED (exit {code})")
with open(status_file, "a") as f:
    f.write(f"{name}\t{code}\t{state}\t{seconds:.0f}\t{limit:.0f}\t{util}\t{mem}\n")
print(f"part {name}: {state} in {seconds:.0f} s (limit {limit:.0f} s); GPU max {util or '?'}% / {mem or '?'} MiB",
      flush=True)
sys.exit(code)
PY

cat >"$WORK/probe.py" <<'PY'
"""The machine and the software, every trainer module imported, a bf16 matmul timed."""
import importlib, importlib.metadata, importlib.util, pkgutil, platform, sys, time
import torch

print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__}; CUDA (build) "
      f"{torch.version.cuda}; cuDNN {torch.backends.cudnn.version()}")
for dist in ("numpy", "triton", "sentencepiece", "tensorboard", "safetensors", "scipy", "matplotlib", "pyarrow",
             "tomli_w", "torchdata", "datasets", "zstandard", "pytest", "pytest-xdist", "transformers"):
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "MISSING"
    print(f"  {dist} {version}")
failed = []
for package in ("trainer", "protocol"):
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
print(f"trainer and protocol modules: {'all import' if not failed else 'IMPORT FAILURES:'}")
for line in failed:
    print("  " + line)
if not torch.cuda.is_available():
    print("CUDA: NOT AVAILABLE")
    sys.exit(3)
p = torch.cuda.get_device_properties(0)
nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
print(f"CUDA device: {torch.cuda.device_count()} x {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} "
      f"SMs, {p.total_memory / 2**30:.1f} GiB; NCCL {nccl}")
from trainer.metrics.step_log import peak_flops_per_device

peak = peak_flops_per_device(torch.device("cuda", 0), 0)
print(f"trainer's MFU peak for this device: {peak / 1e12:.0f} TFLOP/s" if peak else "trainer's MFU peak: none (unknown)")
n = 8192
a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    a @ b
torch.cuda.synchronize()
start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(30):
    a @ b
stop.record()
torch.cuda.synchronize()
print(f"bf16 {n}^3 matmul: {2 * n**3 * 30 / (start.elapsed_time(stop) / 1000) / 1e12:.0f} TFLOP/s")
PY

cat >"$WORK/summarize.py" <<'PY'
"""summary.md from what the parts wrote (argv: WORK OUT_DIR)."""
import json, os, statistics, sys, xml.etree.ElementTree as ET
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
lines = ["# GPU suite", ""]
machine = [line for name in ("machine.log", "probe.log") if (work / name).exists()
           for line in (work / name).read_text().strip().splitlines()]
if machine:
    lines += ["## Machine", "", "```", *machine[-60:], "```", ""]
lines += ["## Parts", "", "| part | status | seconds | limit | GPU max % | GPU max MiB |", "| --- | --- | ---: | ---: | ---: | ---: |"]
status = work / "status.tsv"
for row in (status.read_text().splitlines() if status.exists() else []):
    name, code, state, seconds, limit, util, mem = (row.split("\t") + [""] * 7)[:7]
    lines.append(f"| {name} | {state} | {seconds} | {limit} | {util} | {mem} |")
lines.append("")

xml = out / "cuda_tests.xml"
if xml.exists():
    try:
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines += [f"## tests/cuda (TRAINER_TEST_DEVICE={os.environ.get('TEST_DEVICE', 'cuda')})", "",
                  f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped", ""]
        for case in root.iter("testcase"):
            for bad in list(case.findall("failure")) + list(case.findall("error")):
                message = (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else ""
                lines.append(f"- FAILED {case.get('classname')}::{case.get('name')}: {message}")
        lines.append("")
    except ET.ParseError as e:
        lines += [f"cuda_tests.xml unreadable: {e}", ""]
figures = work / "figures.txt"
if figures.exists():
    lines += ["Figures the tests measured (with pytest-xdist the tests run side by side: their timings are not "
              "benchmarks):", "", "```",
              *sorted(figures.read_text().strip().splitlines()), "```", ""]


def records(folder):
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "kind" not in r]


def steady(rows):
    later = [r for r in rows if r["step"] > 10] or rows[1:] or rows
    return {k: statistics.mean(r[k] for r in later if r.get(k) is not None) if any(r.get(k) is not None for r in later)
            else None for k in ("tokens_per_s", "tflops", "mfu", "step_time_s")}, later


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


bench = {}
for name in ("bench_1b", "bench_1b_eager"):
    rows = records(work / name)
    if not rows:
        continue
    try:
        meta = json.loads((work / name / "run_meta.json").read_text())
        c = meta["config"]
        title = (f"{c['model']['flavor']}, {c['training']['mixed_precision_param']}, "
                 f"{'torch.compile' if c['compile']['enable'] else 'eager'}: 1 process on {meta.get('device_name')}, "
                 f"seq_len {c['training']['seq_len']}, local batch {c['training']['local_batch_size']}")
    except (OSError, KeyError, ValueError):
        title = name
    summary, later = steady(rows)
    bench[name] = summary
    lines += [f"## {title} ({name}, {rows[-1]['step']} steps)", "",
              "| step | loss | tokens/s | TFLOPS | MFU % | s/step | max allocated GiB | max reserved GiB |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        m = r.get("memory", {})
        lines.append(f"| {r['step']} | {r['loss']:.4f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {fmt(r.get('mfu'), '.1f')} "
                     f"| {r['step_time_s']:.3f} | {fmt(m.get('max_allocated_gib'), '.1f')} | {fmt(m.get('max_reserved_gib'), '.1f')} |")
    lines += ["", f"Steady state (mean of the logged windows of steps {later[0]['step'] - 9}-{later[-1]['step']}): "
              f"{fmt(summary['tokens_per_s'], ',.0f')} tokens/s, {fmt(summary['tflops'], '.1f')} TFLOPS, "
              f"MFU {fmt(summary['mfu'], '.1f')} %, {fmt(summary['step_time_s'], '.3f')} s/step "
              "(each logged figure is the mean over the steps since the previous log; step 1 includes compilation)", ""]
if len(bench) == 2 and bench["bench_1b_eager"]["tokens_per_s"]:
    lines += [f"torch.compile speed-up (bench_1b / bench_1b_eager, steady-state tokens/s): "
              f"{bench['bench_1b']['tokens_per_s'] / bench['bench_1b_eager']['tokens_per_s']:.2f}x", ""]
for name, title in (("side_by_side_1b", "1B"), ("side_by_side_8b", "8B cut to 8 layers"),
                    ("float8_8b", "8B cut to 8 layers, bf16 and float8 linear layers")):
    table = work / name / "side_by_side.md"
    if table.exists():
        lines += [f"## Side by side, {title} (benchmarks/side_by_side.py: this trainer, torchtitan, a plain loop)", "",
                  *table.read_text().strip().splitlines(), ""]
profile = work / "profile_1b.log"
if profile.exists():
    rows = [line for line in profile.read_text().splitlines() if line.startswith(("|", "model FLOP/s", "1B", "debugmodel"))]
    lines += ["## Where the trainer's 1B step goes (benchmarks/profile_step.py)", "", *rows, ""]
ring = work / "ring_kernels.log"
if ring.exists():
    rows = [line for line in ring.read_text().splitlines() if line.startswith(("|", "attention forward"))]
    lines += ["## Ring attention kernels per CP rank vs whole-sequence attention (benchmarks/ring_kernels.py)", "",
              *rows, ""]
documents = work / "cp_documents.log"
if documents.exists():
    rows = [line for line in documents.read_text().splitlines() if line.startswith(("|", "#"))]
    lines += ["## Ring attention with documents: one CP rank's peak memory against cp (benchmarks/cp_document_memory.py)",
              "", *rows, ""]
offload = work / "offload_1b.log"
if offload.exists():
    rows = [line for line in offload.read_text().splitlines() if line.startswith(("|", "1 processes"))]
    lines += ["## FSDP with and without CPU offload, one GPU (benchmarks/strategies.py)", "", *rows, ""]
for log, plan in (("protocol_techniques.log", "Technique plan, statistical (protocol/plans/gpu_techniques.toml)"),
                  ("protocol_float8.log", "float8 plan, statistical (protocol/plans/float8_gpu.toml)")):
    protocol = work / log
    if protocol.exists():
        lines += [f"## {plan}", "", "```", *protocol.read_text().strip().splitlines()[-40:], "```", ""]
docmask = out / "document_masking.log"
if docmask.exists():
    text = docmask.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith("debug model")), None)
    if start is not None:
        lines += ["## Document masking (benchmarks/document_masking.py)", "", "```", *text[start:start + 12], "```", ""]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

run_part() {  # run_part NAME MAX_S RESERVE_S LOG COMMAND...: limit = min(MAX, time left - RESERVE)
  local name=$1 max=$2 reserve=$3 log=$4
  shift 4
  local limit=$(( $(left) - reserve ))
  (( limit > max )) && limit=$max
  if (( limit < 20 )); then
    say "part $name: SKIPPED (${limit}s left for it)"
    printf '%s\t\tSKIPPED (no time left)\t0\t%s\t\t\n' "$name" "$limit" >>"$WORK/status.tsv"
    return 0
  fi
  say "part $name: starting, limit ${limit}s; log $log"
  timeout -k 15 $(( limit + 60 )) "$PYTHON" "$WORK/run_part.py" "$name" "$limit" "$log" "$WORK/status.tsv" -- "$@"
  local code=$?
  if (( code != 0 )); then
    say "part $name: last lines of its log:"
    tail -n 25 "$log" | sed 's/^/    /'
  fi
  return 0
}

# --- 1. the machine ---------------------------------------------------------------------------
{
  say "nvidia-smi"
  timeout 30 nvidia-smi || echo "nvidia-smi: not available (exit $?)"
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>/dev/null
  echo "C compiler (Triton and inductor build helpers with it): $(command -v gcc || command -v cc || echo none) $( (gcc --version 2>/dev/null || true) | head -n 1)"
  echo "CPU cores: $(nproc); host memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
} 2>&1 | tee "$WORK/machine.log"
say "software, module imports, bf16 matmul"
timeout 90 "$PYTHON" "$WORK/probe.py" 2>&1 | tee "$WORK/probe.log"
CUDA_OK=0
grep -q '^CUDA device:' "$WORK/probe.log" && CUDA_OK=1

# Each part's time limit in seconds. A part gets min(its limit, time left - the limits of the
# required parts after it - the summary's): a later required part keeps its time even when an
# earlier one runs long; an optional part runs on what is left (skipped under 20 s).
declare -A LIMIT=(
  [cuda_tests]=${GPU_SUITE_TESTS_S:-260}
  [side_by_side_1b]=${GPU_SUITE_SIDE_BY_SIDE_1B_S:-180}
  [side_by_side_8b]=${GPU_SUITE_SIDE_BY_SIDE_8B_S:-200}
  [document_masking]=${GPU_SUITE_MASKING_S:-150}
  [protocol_techniques]=${GPU_SUITE_PROTOCOL_S:-330}
  [ring_kernels]=${GPU_SUITE_RING_S:-60}
  [estimate_1b]=${GPU_SUITE_ESTIMATE_S:-70}
  [bench_1b]=${GPU_SUITE_1B_S:-80}
  [bench_1b_eager]=${GPU_SUITE_1B_EAGER_S:-50}
  [profile_1b]=${GPU_SUITE_PROFILE_S:-120}
  [offload_1b]=${GPU_SUITE_OFFLOAD_S:-150}
  [float8_8b]=${GPU_SUITE_FLOAT8_S:-420}
  [protocol_float8]=${GPU_SUITE_PROTOCOL_FLOAT8_S:-360}
  [cp_documents]=${GPU_SUITE_CP_DOCUMENTS_S:-90}
)
OPTIONAL=" estimate_1b bench_1b bench_1b_eager profile_1b offload_1b float8_8b protocol_float8 cp_documents "
SUMMARY_S=10
# Which parts run, in this order (GPU_SUITE_PARTS="side_by_side_1b estimate_1b" runs two of them).
PARTS=(${GPU_SUITE_PARTS:-cuda_tests side_by_side_1b side_by_side_8b ring_kernels document_masking protocol_techniques estimate_1b
       bench_1b bench_1b_eager profile_1b offload_1b float8_8b protocol_float8 cp_documents})
for part in "${PARTS[@]}"; do
  [ -n "${LIMIT[$part]:-}" ] || { say "GPU_SUITE_PARTS: unknown part '$part'; valid: ${!LIMIT[*]}"; exit 2; }
done

TEST_DEVICE=cuda
TESTS=(tests/cuda)
MODEL=(--model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4)
MASKING=(--seq-len 1024 4096 --steps 20)
ESTIMATE=(--flavor 1B --seq-len 2048 --local-batch 4)
# The ring attention's kernel work per CP rank against whole-sequence flash attention.
RING=(--cp 2 4 8 --seq-lens 8192 32768 --repeats 5)
# One CP rank's ring attention with documents at 32k tokens: peak memory against cp.
CP_DOCUMENTS=(--device cuda --seq-lens 32768 --cp 2 4 8 --fake-seq-len 0)
# FSDP with and without CPU offload on one GPU (the strategies table's GPU row).
OFFLOAD=(--flavor 1B --nproc 1 --only FSDP --ac none --seq-len 2048 --steps 6)
# Where the trainer's 1B step spends its time: the side-by-side 1B case, phase by phase and by kernel.
PROFILE=(--steps 10 --top 25 --model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4
         --training.mixed_precision_param bfloat16 --compile.enable --activation_checkpoint.mode selective
         --activation_checkpoint.selective_ac_option 2 --optimizer.implementation fused --optimizer.lr 1e-4)
# The side-by-side comparison (benchmarks/side_by_side.py): this trainer, torchtitan and a plain loop.
SIDE_BY_SIDE_1B=(--shape 1B --seq-len 2048 --local-batch 4 --modes compile --ac selective --run-timeout 130)
# The technique plan in statistical mode (compile and AC full must pass, a 5% higher lr must fail).
PROTOCOL=(run --compare)
SIDE_BY_SIDE_8B=(--shape 8B-L8 --seq-len 2048 --local-batch 2 --modes compile --ac selective --run-timeout 150)
# float8 against bf16 on the same 8B cut (trainer and torchtitan; the plain loop has no float8).
FLOAT8_8B=(--shape 8B-L8 --seq-len 2048 --local-batch 2 --modes compile --ac selective --systems trainer torchtitan
           --float8 none tensorwise rowwise --run-timeout 120)
if [ "${GPU_SUITE_CPU_SMOKE:-0}" = 1 ]; then
  say "CPU smoke run (GPU_SUITE_CPU_SMOKE=1): no GPU is used"
  export CUDA_VISIBLE_DEVICES=""
  CUDA_OK=1
  TEST_DEVICE=cpu
  TESTS=(tests/cuda/test_in_process.py)
  MODEL=(--model.flavor debugmodel --training.seq_len 128 --training.local_batch_size 4)
  MASKING=(--seq-len 128 --steps 4)
  ESTIMATE=(--flavor debugmodel --seq-len 128 --local-batch 4)
  RING=(--cp 2 --seq-lens 256 --heads 4 --kv-heads 2 --repeats 1)
  CP_DOCUMENTS=(--seq-lens 2048 --cp 2 4 --fake-seq-len 0 --kernels device)
  OFFLOAD=(--flavor debugmodel --nproc 1 --only FSDP --ac none --seq-len 128 --steps 3)
  PROFILE=(--steps 2 --top 5 --model.flavor debugmodel --training.seq_len 128 --training.local_batch_size 4)
  SIDE_BY_SIDE_1B=(--dry-run)
  # A shared CPU is slower than any GPU at these parts: three times each GPU limit (unless set).
  for part in "${!LIMIT[@]}"; do LIMIT[$part]=$(( LIMIT[$part] * 3 )); done
  [ -z "${GPU_SUITE_BUDGET_S:-}" ] && BUDGET=$(( BUDGET * 3 ))
  SIDE_BY_SIDE_8B=(--dry-run --ac full)
  FLOAT8_8B=(--dry-run --systems trainer --float8 tensorwise)
  PROTOCOL=(plan)  # expands and checks the plan; runs nothing
  # torchtitan is not among the project's dependencies: side_by_side.py leaves it out where it is absent.
fi

after() {  # seconds the required parts selected after $1 keep, plus the summary's
  local seen=0 total=$SUMMARY_S part
  for part in "${PARTS[@]}"; do
    (( seen )) && [[ "$OPTIONAL" != *" $part "* ]] && total=$(( total + LIMIT[$part] ))
    [ "$part" = "$1" ] && seen=1
  done
  echo "$total"
}

BENCH_1B=("${MODEL[@]}" --training.mixed_precision_param bfloat16 --training.steps 30 --metrics.log_freq 10
          --metrics.no_enable_tensorboard)

# --- the CUDA test subset ---------------------------------------------------------------------
part_cuda_tests() {
  local xdist=()
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    xdist=(-n "${GPU_SUITE_XDIST_WORKERS:-6}" --dist loadfile)
  fi
  run_part cuda_tests "${LIMIT[cuda_tests]}" "$(after cuda_tests)" "$OUT_DIR/cuda_tests.log" \
    env TRAINER_TEST_DEVICE="$TEST_DEVICE" TRAINER_TEST_FIGURES="$WORK/figures.txt" \
    "$PYTHON" -m pytest "${TESTS[@]}" -v -rA --durations=0 -p no:cacheprovider -o addopts= "${xdist[@]}" \
    --basetemp="$WORK/pytest" --junitxml="$OUT_DIR/cuda_tests.xml"
  grep -E '^(=+ .*(passed|failed|error).* =+|FAILED|ERROR)' "$OUT_DIR/cuda_tests.log" | tail -n 30
}

# --- this trainer beside torchtitan and a plain loop ---------------------------------------------
part_side_by_side_1b() {
  run_part side_by_side_1b "${LIMIT[side_by_side_1b]}" "$(after side_by_side_1b)" "$WORK/side_by_side_1b.log" \
    "$PYTHON" benchmarks/side_by_side.py "${SIDE_BY_SIDE_1B[@]}" --out "$WORK/side_by_side_1b"
  grep -E '^\|' "$WORK/side_by_side_1b.log" | tail -n 8
}
part_side_by_side_8b() {
  run_part side_by_side_8b "${LIMIT[side_by_side_8b]}" "$(after side_by_side_8b)" "$WORK/side_by_side_8b.log" \
    "$PYTHON" benchmarks/side_by_side.py "${SIDE_BY_SIDE_8B[@]}" --out "$WORK/side_by_side_8b"
  grep -E '^\|' "$WORK/side_by_side_8b.log" | tail -n 8
}

# --- the 1B benchmark, its eager twin ------------------------------------------------------------
part_bench_1b() {
  run_part bench_1b "${LIMIT[bench_1b]}" "$(after bench_1b)" "$OUT_DIR/bench_1b.log" \
    env NGPU=1 ./torchrun_launch.sh "${BENCH_1B[@]}" --compile.enable --job.dump_folder "$WORK/bench_1b"
  grep -E 'step +[0-9]+ +loss|error' "$OUT_DIR/bench_1b.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 6
}
part_bench_1b_eager() {
  run_part bench_1b_eager "${LIMIT[bench_1b_eager]}" "$(after bench_1b_eager)" "$WORK/bench_1b_eager.log" \
    env NGPU=1 ./torchrun_launch.sh "${BENCH_1B[@]}" --job.dump_folder "$WORK/bench_1b_eager"
}

# --- document masking ----------------------------------------------------------------------------
part_document_masking() {
  run_part document_masking "${LIMIT[document_masking]}" "$(after document_masking)" \
    "$OUT_DIR/document_masking.log" env NGPU=1 "$PYTHON" benchmarks/document_masking.py "${MASKING[@]}"
  tail -n 4 "$OUT_DIR/document_masking.log"
}

# --- the technique plan, judged statistically --------------------------------------------------
part_protocol_techniques() {
  # The plan with its output in the scratch folder: a run of the suite leaves the user's
  # outputs/protocol/gpu_techniques alone.
  sed "s|^output = .*|output = \"$WORK/protocol_out\"|" protocol/plans/gpu_techniques.toml >"$WORK/gpu_techniques.toml"
  run_part protocol_techniques "${LIMIT[protocol_techniques]}" "$(after protocol_techniques)" \
    "$WORK/protocol_techniques.log" "$PYTHON" -m protocol.cli "${PROTOCOL[0]}" "$WORK/gpu_techniques.toml" "${PROTOCOL[@]:1}"
  tail -n 20 "$WORK/protocol_techniques.log"
}

# --- float8 linear layers: speed against bf16 and torchtitan, and the statistical plan ---------------
part_float8_8b() {
  run_part float8_8b "${LIMIT[float8_8b]}" "$(after float8_8b)" "$WORK/float8_8b.log" \
    "$PYTHON" benchmarks/side_by_side.py "${FLOAT8_8B[@]}" --out "$WORK/float8_8b"
  grep -E '^\|' "$WORK/float8_8b.log" | tail -n 8
}
part_protocol_float8() {
  sed "s|^output = .*|output = \"$WORK/protocol_float8_out\"|" protocol/plans/float8_gpu.toml >"$WORK/float8_gpu.toml"
  run_part protocol_float8 "${LIMIT[protocol_float8]}" "$(after protocol_float8)" \
    "$WORK/protocol_float8.log" "$PYTHON" -m protocol.cli "${PROTOCOL[0]}" "$WORK/float8_gpu.toml" "${PROTOCOL[@]:1}"
  tail -n 20 "$WORK/protocol_float8.log"
}

# --- the memory estimator against the allocator's peak of a real 1B run ----------------------------
part_estimate_1b() {
  run_part estimate_1b "${LIMIT[estimate_1b]}" "$(after estimate_1b)" "$WORK/estimate_1b.log" \
    "$PYTHON" benchmarks/estimate_vs_device.py "${ESTIMATE[@]}"
  grep -E '^\|' "$WORK/estimate_1b.log" | tail -n 3
}

# --- a profile of the trainer's 1B step -------------------------------------------------------------
part_profile_1b() {
  run_part profile_1b "${LIMIT[profile_1b]}" "$(after profile_1b)" "$WORK/profile_1b.log" \
    env NGPU=1 "$PYTHON" benchmarks/profile_step.py "${PROFILE[@]}" --trace "$WORK/profile_1b_trace.json"
  grep -E '^\|' "$WORK/profile_1b.log" | head -n 12
  if [ -f "$WORK/profile_1b_trace.json" ]; then  # for chrome://tracing or Perfetto
    gzip -c "$WORK/profile_1b_trace.json" >"$OUT_DIR/profile_1b_trace.json.gz" && rm "$WORK/profile_1b_trace.json"
  fi
}

# --- ring attention kernels against whole-sequence attention ----------------------------------------
part_ring_kernels() {
  run_part ring_kernels "${LIMIT[ring_kernels]}" "$(after ring_kernels)" "$WORK/ring_kernels.log" \
    "$PYTHON" benchmarks/ring_kernels.py "${RING[@]}"
  grep -E '^\|' "$WORK/ring_kernels.log" | tail -n 14
}

# --- ring attention with documents: memory per rank against cp ---------------------------------------
part_cp_documents() {
  run_part cp_documents "${LIMIT[cp_documents]}" "$(after cp_documents)" "$WORK/cp_documents.log" \
    "$PYTHON" benchmarks/cp_document_memory.py "${CP_DOCUMENTS[@]}"
  grep -E '^\|' "$WORK/cp_documents.log" | tail -n 5
}

# --- FSDP with and without CPU offload ---------------------------------------------------------------
part_offload_1b() {
  run_part offload_1b "${LIMIT[offload_1b]}" "$(after offload_1b)" "$WORK/offload_1b.log" \
    "$PYTHON" benchmarks/strategies.py "${OFFLOAD[@]}"
  grep -E '^\|' "$WORK/offload_1b.log" | tail -n 5
}

for part in "${PARTS[@]}"; do
  if (( CUDA_OK )) || [ "$part" = cuda_tests ]; then
    "part_$part"
  else
    say "part $part: SKIPPED (no CUDA device)"
    printf '%s\t\tSKIPPED (no CUDA device)\t0\t%s\t\t\n' "$part" "${LIMIT[$part]}" >>"$WORK/status.tsv"
  fi
done

# --- summary and the details archive ------------------------------------------------------------
(cd "$WORK" && find . -type f -size -2M ! -name '*.distcp' ! -name '*.pt' ! -path './pytest/*/checkpoint/*' \
   -print0 | tar czf "$OUT_DIR/details.tar.gz" --null -T - 2>/dev/null) || say "packing the details failed"
say "summary ($OUT_DIR/summary.md):"
TEST_DEVICE="$TEST_DEVICE" timeout 60 "$PYTHON" "$WORK/summarize.py" "$WORK" "$OUT_DIR" || say "the summary failed"
say "done in $(elapsed)s; files in $OUT_DIR: $(cd "$OUT_DIR" && ls | tr '\n' ' ')"

# Exit status: 1 when a part did not end ok (failed, timed out, skipped) or no CUDA device was found.
NOT_OK=$(awk -F'\t' '$3 != "ok" {printf "%s (%s); ", $1, $3}' "$WORK/status.tsv" 2>/dev/null)
(( CUDA_OK )) || NOT_OK+="no CUDA device; "
if [ -n "$NOT_OK" ]; then
  say "NOT OK: $NOT_OK"
  exit 1
fi
