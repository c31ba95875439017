"""The estimator (python -m trainer.estimate) against real runs of the same job on this CPU.

    python benchmarks/estimate_accuracy.py [--flavor debugmodel] [--seq-len 128] [--local-batch 4]
                                           [--layouts NAME ...] [--json FILE]

For each layout, the job runs for real under torchrun (gloo): each rank builds the trainer, runs
one training step and reports what it holds (the estimator's exact counting) and the peak of the
estimator's memory tracker over its real tensors. The estimator then runs the same job on fake
tensors in a fake world. The table shows both per rank kind: the state bytes must be equal; the
step peaks show how closely fake tensors and a fake process group reproduce the real step. Both
compute in float32, the CPU's precision.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, machine, table  # noqa: I001 (sets sys.path)

TP2, PP2 = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"]
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
LAYOUTS = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "FSDP 2 x TP 2": (4, TP2),
    "PP 2 Interleaved1F1B": (2, [*PP2, *INTERLEAVED]),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "FSDP 2 x TP 2 x PP 2, AC full": (8, [*TP2, *PP2, *INTERLEAVED, "--activation_checkpoint.mode", "full"]),
    "FSDP 2 x TP 2 x PP 2, AC selective": (8, [*TP2, *PP2, *INTERLEAVED, "--activation_checkpoint.mode", "selective"]),
}


def real_run(nproc: int, overrides: list[str], folder: Path) -> dict[int, dict]:
    """Each rank's figures of one real training step (this file's --worker mode under torchrun)."""
    out = folder / "figures"
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), __file__,
         "--worker", str(out), *overrides, "--job.dump_folder", str(folder / "run")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{nproc}-process run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {int(f.stem.removeprefix("rank")): json.loads(f.read_text()) for f in out.glob("rank*.json")}


def compare(name: str, nproc: int, overrides: list[str], folder: Path) -> list[dict]:
    """One row per rank kind: estimated and real state bytes and step peaks."""
    from trainer.estimate.job import estimate_kinds, estimated_config
    from trainer.estimate.rank import rank_kinds
    from trainer.parallel.dims import stage_plan
    from trainer.preflight.checks import plan_layout

    real = real_run(nproc, overrides, folder)
    config, _ = estimated_config(overrides)
    plan = plan_layout(config, nproc)
    rows = []
    for e in estimate_kinds(overrides, nproc, rank_kinds(plan.dims, stage_plan(config, plan.dims)), steps=1):
        measured = real[e.kind.rank]
        rows.append({"layout": name, "kind": e.kind.name, "rank": e.kind.rank,
                     "estimated_state": [e.state.parameters, e.state.gradients, e.state.optimizer],
                     "real_state": [measured["parameters"], measured["gradients"], measured["optimizer"]],
                     "estimated_peak": e.step_peak.total, "real_peak": measured["step_peak"]["total"]})
    return rows


def worker(out: Path, overrides: list[str]) -> None:
    from trainer.config.manager import load_config, with_default_config
    from trainer.estimate.rank import state_bytes
    from trainer.estimate.step_memory import StepMemory
    from trainer.preflight.checks import plan_run
    from trainer.launch.process_exit import exit_without_teardown
    from trainer.train import Trainer

    config = load_config(with_default_config(overrides))
    trainer = Trainer(config, plan_run(config, int(os.environ["WORLD_SIZE"])))
    batch = trainer.loader.next_batch()
    memory = StepMemory()
    memory.track_external(trainer.model, trainer.optimizer)
    with memory:  # what Trainer.train_step does, with the state counted between backward and the update
        trainer.runner.forward_backward(batch)
        state = state_bytes(trainer.model, trainer.optimizer)
        trainer._clip()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    figures = {"parameters": state.parameters, "gradients": state.gradients, "optimizer": state.optimizer,
               "step_peak": memory.peak().as_dict()}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(figures))
    trainer.close()
    exit_without_teardown(0)  # as the trainer ends: a gloo thread can abort the interpreter's teardown


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), sys.argv[3:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), metavar="NAME")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    job = ["--model.flavor", a.flavor, "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
           str(a.local_batch), "--metrics.no_enable_tensorboard", "--training.mixed_precision_param", "float32"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, name in enumerate(a.layouts):
            nproc, args = LAYOUTS[name]
            rows += compare(name, nproc, [*job, *args], Path(tmp) / str(index))
    print("python benchmarks/estimate_accuracy.py " + " ".join(shlex.quote(arg) for arg in sys.argv[1:]))
    print(machine())
    print(table(["layout", "rank kind", "state bytes (params + grads + optim)", "equal", "step peak estimated",
                 "step peak real", "difference"],
                [[r["layout"], r["kind"], f"{sum(r['estimated_state']):,}",
                  "yes" if r["estimated_state"] == r["real_state"] else "NO", f"{r['estimated_peak']:,}",
                  f"{r['real_peak']:,}", f"{100 * (r['estimated_peak'] / r['real_peak'] - 1):+.1f}%"] for r in rows]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
