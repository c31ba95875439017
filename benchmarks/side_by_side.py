"""This trainer, torchtitan and a plain loop, trained on the same shape on one device, side by side.

    python benchmarks/side_by_side.py --shape 1B --seq-len 2048 --local-batch 4 --modes compile eager \
        --ac none selective full [--systems trainer torchtitan plain] [--steps 30] [--warmup 10] [--out DIR]
        [--trainer-args "--section.key value ..."] [--float8 none tensorwise rowwise]
    python benchmarks/side_by_side.py --dry-run        (CPU, a tiny shape: checks the script, measures nothing)

For each case (sequence length x eager/compile x activation checkpointing) it trains the same
Llama shape three ways, each in its own process under a time limit (--run-timeout):

* trainer: this trainer (`torchrun_launch.sh`, one process, bf16 mixed precision, model.flavor
  "hf" with the shape's config.json, the synthetic data source); figures from its metrics.jsonl;
* torchtitan: torchtitan's trainer (benchmarks/peer_torchtitan.py; the PyPI release that runs on
  the machine's torch must be importable: see below), its Llama with the same shape, its data
  loader on a local text file, bf16 autocast (torchtitan's mixed precision on one device);
  figures from its log lines;
* plain: benchmarks/plain_loop.py, the trainer's model in a hand-written loop (autocast bf16,
  fused AdamW, no framework): the floor of framework overhead.

All three use AdamW (lr 1e-4; the "fused" implementation where the device has one), gradient
clipping at 1.0, the same local batch and sequence length, and selective checkpointing of every
second block (selective_ac_option "2"; full: every block). Tokens/s is the mean over the steps after --warmup
(the logging windows that start after it); MFU is computed here, for all three alike, from the
trainer's FLOPs-per-token formula (trainer.models.llama3.args.flops_per_token, the same 6N + 12LHQT
torchtitan uses) and the device's dense bf16 peak (trainer.metrics.step_log). Memory is the CUDA caching
allocator's peak reserved bytes (all three report it) and, where reported, peak allocated.

Shapes: "1B" is Llama 3.2 1B with an untied output layer (torchtitan's Llama 3 has no tied
embeddings), "8B-L<n>" the 8B flavor cut to n layers (default 8) to fit one GPU, "tiny" the dry
run's. torchtitan on a GPU machine without network: carry its wheel and the pure-Python wheels it
needs (torchtitan==0.2.2, torchdata, datasets, dill, multiprocess, tyro, docstring-parser,
typeguard, shtab, tomli, einops) in .whl/; benchmarks/gpu_suite.sh installs them. Results go to
--out: side_by_side.json (every run) and side_by_side.md (the table printed at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import REPO  # noqa: I001 (sets sys.path)
from trainer.models.llama3.args import FLAVORS, LlamaModelArgs, flops_per_token
from trainer.models.llama3.hf_config import hf_config

SYSTEMS = ("trainer", "torchtitan", "plain")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TORCHTITAN_STEP = re.compile(r"step:\s*(\d+).*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+)")


def shape_args(name: str) -> LlamaModelArgs:
    if name == "tiny":
        return LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32)
    if name == "1B":
        return dataclasses.replace(FLAVORS["1B"], tie_embeddings=False)
    match = re.fullmatch(r"8B-L(\d+)", name)
    if match:
        return dataclasses.replace(FLAVORS["8B"], n_layers=int(match.group(1)))
    raise SystemExit(f"--shape: unknown shape {name!r}; valid: 1B, 8B-L<layers> (e.g. 8B-L8), tiny")


# ---------------------------------------------------------------------------------------------
# inputs each system reads: the shape in three spellings, a tokenizer and a text file


def write_inputs(args: LlamaModelArgs, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    hf = folder / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(hf_config(args), indent=1))
    words = write_tokenizer(hf, min(args.vocab_size, 4096))
    rng = random.Random(0)
    with open(folder / "text.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=4096))}) + "\n")
    torchtitan = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.kv_heads,
                  "vocab_size": args.vocab_size, "multiple_of": args.multiple_of,
                  "ffn_dim_multiplier": args.ffn_dim_multiplier, "norm_eps": args.norm_eps,
                  "rope_theta": args.rope_theta}
    (folder / "torchtitan_shape.json").write_text(json.dumps(torchtitan))
    plain = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
             if f.name not in ("rope_scaling", "max_seq_len")}
    (folder / "plain_shape.json").write_text(json.dumps(plain))
    return {"hf": hf, "text": folder / "text.jsonl", "torchtitan_shape": folder / "torchtitan_shape.json",
            "plain_shape": folder / "plain_shape.json"}


def write_tokenizer(folder: Path, size: int) -> list[str]:
    """A word-level tokenizer.json of `size` entries (ids below every shape's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(size - 3)]
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}))
    return words


# ---------------------------------------------------------------------------------------------
# one run of each system


@dataclasses.dataclass
class Case:
    seq_len: int
    compile: bool
    ac: str
    float8: str = "none"  # none, or the float8 recipe of the block linears (tensorwise, rowwise)

    @property
    def label(self) -> str:
        return (f"seq {self.seq_len}, {'compile' if self.compile else 'eager'}, AC {self.ac}"
                + (f", float8 {self.float8}" if self.float8 != "none" else ""))


def trainer_float8_args(case: Case) -> list[str]:
    """The trainer's float8 options (docs/training.md, float8 linear layers)."""
    if case.float8 == "none":
        return []
    recipe = ["--quantize.linear.float8.recipe_name", case.float8] if case.float8 != "tensorwise" else []
    return ["--model.converters", "quantize.linear.float8", *recipe]


def torchtitan_float8_tables(case: Case) -> list[str]:
    """torchtitan's float8 options, the same layers converted (its filter_fqns keeps the output
    projection, which this trainer always keeps)."""
    if case.float8 == "none":
        return []
    recipe = f'recipe_name = "{case.float8}"\n' if case.float8 != "tensorwise" else ""
    return [f'[quantize.linear.float8]\n{recipe}filter_fqns = ["output"]']


def trainer_command(case: Case, opts, inputs, folder: Path) -> list[str]:
    command = ["./torchrun_launch.sh", "--model.flavor", "hf", "--model.hf_assets_path", str(inputs["hf"]),
               "--training.dataset", "synthetic", "--training.seq_len", str(case.seq_len),
               "--training.local_batch_size", str(opts.local_batch), "--training.steps", str(opts.steps),
               "--training.mixed_precision_param", "bfloat16", "--optimizer.implementation", opts.optimizer,
               "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", case.ac,
               "--activation_checkpoint.selective_ac_option", "2", "--metrics.log_freq", str(opts.log_freq),
               "--metrics.no_enable_tensorboard", "--job.dump_folder", str(folder)]
    return (command + (["--compile.enable"] if case.compile else []) + trainer_float8_args(case)
            + shlex.split(opts.trainer_args))


def torchtitan_command(case: Case, opts, inputs, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    toml = folder / "torchtitan.toml"
    toml.write_text("\n".join([
        f'[job]\ndump_folder = "{folder}"',
        f'[model]\nname = "llama3"\nflavor = "side_by_side"\nhf_assets_path = "{inputs["hf"]}"'
        + ('\nconverters = ["quantize.linear.float8"]' if case.float8 != "none" else ""),
        *torchtitan_float8_tables(case),
        f'[optimizer]\nname = "AdamW"\nlr = 1e-4\nimplementation = "{opts.optimizer}"',
        '[lr_scheduler]\nwarmup_steps = 2',
        f'[training]\ndataset = "side_by_side"\nlocal_batch_size = {opts.local_batch}\nseq_len = {case.seq_len}\n'
        f'steps = {opts.steps}\nmax_norm = 1.0\nmixed_precision_param = "bfloat16"',
        '[parallelism]\ndata_parallel_shard_degree = -1',
        f'[activation_checkpoint]\nmode = "{case.ac}"\nselective_ac_option = "2"',
        f'[compile]\nenable = {"true" if case.compile else "false"}',
        f'[metrics]\nlog_freq = {opts.log_freq}\nenable_tensorboard = false',
        '[checkpoint]\nenable = false', ""]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "benchmarks/peer_torchtitan.py", "--shape", str(inputs["torchtitan_shape"]), "--text", str(inputs["text"])]
    return command + (["--cpu"] if opts.device == "cpu" else []) + ["--", "--job.config_file", str(toml)]


def plain_command(case: Case, opts, inputs, folder: Path) -> list[str]:
    command = [sys.executable, "benchmarks/plain_loop.py", "--shape", str(inputs["plain_shape"]), "--seq-len",
               str(case.seq_len), "--local-batch", str(opts.local_batch), "--steps", str(opts.steps), "--warmup",
               str(opts.warmup), "--ac", case.ac, "--device", opts.device]
    return command + (["--compile"] if case.compile else [])


def run(command: list[str], log: Path, timeout: float, env: dict) -> tuple[str, float]:
    """Run `command` in its own session with output to `log`; its whole process group is ended at
    `timeout`. Returns (status, seconds)."""
    began = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return f"timed out ({timeout:.0f} s)", time.time() - began
    return ("ok" if code == 0 else f"failed (exit {code})"), time.time() - began


# ---------------------------------------------------------------------------------------------
# reading each system's figures


def trainer_figures(folder: Path, log: Path, warmup: int, log_freq: int) -> dict:
    rows = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "kind" not in r]
    later = [r for r in rows if r["step"] - log_freq >= warmup]
    memory = [r.get("memory", {}) for r in rows]
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in later) / len(later),
            "max_reserved_gib": max((m.get("max_reserved_gib") or 0 for m in memory), default=None) or None,
            "max_allocated_gib": max((m.get("max_allocated_gib") or 0 for m in memory), default=None) or None,
            "losses": [round(r["loss"], 4) for r in rows]}


def torchtitan_figures(folder: Path, log: Path, warmup: int, log_freq: int) -> dict:
    rows = [(int(s), float(m), float(t.replace(",", ""))) for s, m, t in
            TORCHTITAN_STEP.findall(ANSI.sub("", log.read_text()))]
    later = [r for r in rows if r[0] - log_freq >= warmup]
    if not later:
        raise ValueError(f"no torchtitan step line after step {warmup} in {log}")
    return {"tokens_per_s": sum(r[2] for r in later) / len(later),
            "max_reserved_gib": max(r[1] for r in rows) if max(r[1] for r in rows) > 0 else None, "max_allocated_gib": None}


def plain_figures(folder: Path, log: Path, warmup: int, log_freq: int) -> dict:
    line = next(line for line in reversed(log.read_text().splitlines()) if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    return {k: result.get(k) for k in ("tokens_per_s", "max_reserved_gib", "max_allocated_gib", "losses")}


COMMANDS = {"trainer": trainer_command, "torchtitan": torchtitan_command, "plain": plain_command}
FIGURES = {"trainer": trainer_figures, "torchtitan": torchtitan_figures, "plain": plain_figures}


# ---------------------------------------------------------------------------------------------


def peak_flops(device: str) -> float | None:
    import torch

    from trainer.metrics.step_log import peak_flops_per_device

    if device == "cpu" or not torch.cuda.is_available():
        return None
    return peak_flops_per_device(torch.device("cuda", 0), 0)


def table(results: list[dict], shape: str, device_line: str) -> str:
    lines = [f"Shape {shape}; {device_line}", "",
             "| case | system | status | tokens/s | vs trainer | vs trainer without float8 | MFU % | max reserved GiB "
             "| max allocated GiB |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def trainer_tps(case: str) -> float | None:
        return next((b["tokens_per_s"] for b in results if b["case"] == case and b["system"] == "trainer"
                     and b.get("tokens_per_s")), None)

    for r in results:
        tps, base = r.get("tokens_per_s"), trainer_tps(r["case"])
        # MFU counts the model's FLOPs at the bf16 peak, float8 cases too: their speed-up shows as MFU above bf16's.
        high_precision = trainer_tps(r["case"].split(", float8 ")[0])
        ratio = f"{tps / base:.2f}x" if tps and base else "n/a"
        float8_ratio = f"{tps / high_precision:.2f}x" if tps and high_precision and ", float8 " in r["case"] else ""
        mfu = f"{r['mfu']:.1f}" if r.get("mfu") is not None else "n/a"
        gib = lambda k: f"{r[k]:.1f}" if r.get(k) else "n/a"  # noqa: E731
        lines.append(f"| {r['case']} | {r['system']} | {r['status']} | {f'{tps:,.0f}' if tps else 'n/a'} | {ratio} "
                     f"| {float8_ratio} | {mfu} | {gib('max_reserved_gib')} | {gib('max_allocated_gib')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1B", help="1B, 8B-L<layers> or tiny (default 1B)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048])
    parser.add_argument("--local-batch", type=int, default=4)
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["compile"])
    parser.add_argument("--ac", nargs="+", choices=("none", "selective", "full"), default=["selective"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--float8", nargs="+", choices=("none", "tensorwise", "rowwise"), default=["none"],
                        help="float8 linear layers in the blocks (trainer and torchtitan; the plain loop has "
                             "none and runs only without): none, tensorwise, rowwise (default none)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s (compilation)")
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds per run (default 240)")
    parser.add_argument("--out", default="outputs/side_by_side", help="results folder (default outputs/side_by_side)")
    parser.add_argument("--trainer-args", default="", help="more overrides for the trainer's runs, one string "
                        "(e.g. \"--profiling.enable_profiling\")")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, eager, 6 steps: checks the script")
    opts = parser.parse_args()
    if opts.dry_run:
        opts.shape, opts.seq_len, opts.local_batch, opts.modes = "tiny", [64], 2, ["eager"]
        opts.steps, opts.warmup, opts.log_freq = 6, 2, 2
    if opts.steps < opts.warmup + opts.log_freq:
        parser.error(f"--steps must be at least --warmup + --log-freq ({opts.warmup + opts.log_freq})")
    if "torchtitan" in opts.systems and importlib.util.find_spec("torchtitan") is None:
        print("[side_by_side] torchtitan is not installed: leaving it out (docs/performance.md, 'On a GPU', lists "
              "the wheels to install)", flush=True)
        opts.systems = [system for system in opts.systems if system != "torchtitan"]
    import torch

    opts.device = "cuda" if torch.cuda.is_available() and not opts.dry_run else "cpu"
    opts.optimizer = "fused" if opts.device == "cuda" else "foreach"
    args = shape_args(opts.shape)
    out = (REPO / opts.out).resolve() if not os.path.isabs(opts.out) else Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    inputs = write_inputs(args, out / "inputs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HOME": str(out / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "NGPU": "1",
           "PYTHONUNBUFFERED": "1"}
    if opts.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    peak = peak_flops(opts.device)
    device_line = (f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}" if opts.device == "cuda"
                   else f"device: CPU (dry run), torch {torch.__version__}")
    results = []
    for seq_len in opts.seq_len:
        for mode in opts.modes:
            for ac, float8 in [(ac, float8) for ac in opts.ac for float8 in opts.float8]:
                case = Case(seq_len, mode == "compile", ac, float8)
                per_token = flops_per_token(dataclasses.replace(args, max_seq_len=seq_len), seq_len)
                for system in [s for s in opts.systems if float8 == "none" or s != "plain"]:
                    folder = out / (f"{system}_{seq_len}_{mode}_{ac}" + ("" if float8 == "none" else f"_float8_{float8}"))
                    log = out / f"{folder.name}.log"
                    command = COMMANDS[system](case, opts, inputs, folder)
                    print(f"[side_by_side] {case.label}: {system}: {' '.join(command)}", flush=True)
                    status, seconds = run(command, log, opts.run_timeout, env)
                    row = {"case": case.label, "system": system, "status": status, "seconds": round(seconds, 1),
                           "command": command, "log": str(log)}
                    if status == "ok":
                        try:
                            row.update(FIGURES[system](folder, log, opts.warmup, opts.log_freq))
                        except (OSError, ValueError, KeyError, StopIteration, ZeroDivisionError) as e:
                            row["status"] = f"unreadable ({type(e).__name__}: {e})"
                    if row.get("tokens_per_s") and peak:
                        row["mfu"] = 100.0 * row["tokens_per_s"] * per_token / peak
                    else:
                        row["mfu"] = None
                    print(f"[side_by_side] {case.label}: {system}: {row['status']} in {seconds:.0f} s; "
                          f"tokens/s {row.get('tokens_per_s')}", flush=True)
                    if row["status"] != "ok":
                        print("    " + "\n    ".join(log.read_text().splitlines()[-15:]), flush=True)
                    results.append(row)
    text = table(results, opts.shape, device_line)
    (out / "side_by_side.json").write_text(json.dumps({"shape": opts.shape, "device": device_line,
                                                       "local_batch": opts.local_batch, "steps": opts.steps,
                                                       "warmup": opts.warmup, "results": results}, indent=1))
    (out / "side_by_side.md").write_text(text + "\n")
    print(text)
    sys.exit(0 if all(r["status"] == "ok" for r in results) else 1)


if __name__ == "__main__":
    main()
