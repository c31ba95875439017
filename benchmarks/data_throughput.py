"""Data-loader throughput next to the trainer's, on the debug model.

    python benchmarks/data_throughput.py [--seconds 3] [--steps 30]

Prints a table: tokens/s of the batch loader alone (one process, one core, the debug config's
batch shape) and the trainer's steady-state tokens/s per device (1 process, debug model), and
their ratio. The loader must be >= 10x faster so data never limits training.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config.manager import load_config  # noqa: E402
from trainer.data.loader import BatchLoader  # noqa: E402
from trainer.data.synthetic import SyntheticMarkovSource  # noqa: E402
from trainer.models.llama3.hf_config import configured_model_args  # noqa: E402


def loader_tokens_per_s(config, seconds: float) -> float:
    vocab_size = configured_model_args(config.model).vocab_size
    source = SyntheticMarkovSource(vocab_size=vocab_size, seed=config.debug.seed)
    loader = BatchLoader(source, seq_len=config.training.seq_len, global_batch_size=config.training.local_batch_size,
                         local_batch_size=config.training.local_batch_size, dp_rank=0, dp_degree=1,
                         device=torch.device("cpu"))
    loader.next_batch()  # warm up
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for inputs, _ in loader.next_batch():
            tokens += inputs.numel()
    return tokens / (time.perf_counter() - start)


def trainer_tokens_per_s(steps: int) -> float:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        subprocess.run(
            [sys.executable, "-m", "trainer.train", "--job.config_file", "debug_model.toml",
             "--training.steps", str(steps), "--metrics.log_freq", str(steps // 3), "--metrics.no_enable_tensorboard",
             "--job.dump_folder", dump],
            check=True, env=env, cwd=REPO, capture_output=True,
        )
        records = [json.loads(line) for line in open(Path(dump) / "metrics.jsonl")]
        return records[-1]["tokens_per_s"]  # the last window: steady state, past warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to time the loader")
    parser.add_argument("--steps", type=int, default=30, help="training steps for the trainer figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config(["--job.config_file", "debug_model.toml"])
    loader = loader_tokens_per_s(config, args.seconds)
    trainer = trainer_tokens_per_s(args.steps)
    shape = f"{config.training.local_batch_size} x {config.training.seq_len}"
    print(f"debug model ({config.model.flavor}), synthetic source, batch {shape}, 1 process, OMP_NUM_THREADS=1")
    print(f"{'what':<28}{'tokens/s':>14}")
    print(f"{'loader alone (1 core)':<28}{loader:>14,.0f}")
    print(f"{'trainer (per device)':<28}{trainer:>14,.0f}")
    print(f"{'loader / trainer':<28}{loader / trainer:>14.1f}x")


if __name__ == "__main__":
    main()
