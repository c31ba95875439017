"""What document masking costs: training tokens/s with and without it, on the same shards.

    python benchmarks/document_masking.py [--seq-len 512 1024] [--steps 12] [--nproc 1] [--kernels mask flex]

Prepares a shard folder from generated documents (mean about 100 tokens, so a sequence of 512
holds several documents and the mask cuts attention a lot), then trains the debug model on it
for --steps steps per setting and prints the steady-state tokens/s (the last logging window) and
the final loss, with plain packing and with training.document_masking, for each of --kernels
(training.document_masking_kernel; default: mask and flex on a GPU, mask on a CPU, where flex
attention has no backward).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prepare_folder(folder: Path) -> Path:
    from tests.unit.test_tokenizer import sentences
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import train_tokenizer

    corpus = folder / "corpus.jsonl"
    documents = sentences(40_000, seed=3)
    corpus.write_text("".join(json.dumps({"text": " ".join(documents[i:i + 6])}) + "\n" for i in range(0, 40_000, 6)))
    tokenizer = train_tokenizer([str(corpus)], str(folder / "tok"), 512)
    prepare([str(corpus)], str(tokenizer), str(folder / "shards"), workers=1)
    return folder / "shards"


def train(shards: Path, seq_len: int, steps: int, nproc: int, kernel: str | None) -> tuple[float, float]:
    """(tokens/s, loss); kernel None: plain packing, else document masking with that kernel."""
    with tempfile.TemporaryDirectory() as dump:
        args = ["./torchrun_launch.sh", "--training.dataset", "shards", "--training.dataset_path", str(shards),
                "--training.seq_len", str(seq_len), "--training.local_batch_size", "4", "--training.steps",
                str(steps), "--metrics.log_freq", str(steps // 2), "--metrics.no_enable_tensorboard",
                "--job.dump_folder", dump]
        if kernel is not None:
            args += ["--training.document_masking", "--training.document_masking_kernel", kernel]
        subprocess.run(args, check=True, cwd=REPO, capture_output=True,
                       env=dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable))
        records = [json.loads(line) for line in open(Path(dump) / "metrics.jsonl")]
        last = [r for r in records if "kind" not in r][-1]
        return last["tokens_per_s"], last["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--kernels", nargs="+", choices=("mask", "flex"), default=None,
                        help="document masking kernels to time (default: mask and flex on a GPU, mask on a CPU)")
    args = parser.parse_args()
    if args.kernels is None:
        import torch

        args.kernels = ["mask", "flex"] if torch.cuda.is_available() else ["mask"]
    with tempfile.TemporaryDirectory() as folder:
        shards = prepare_folder(Path(folder))
        print(f"debug model, local batch 4, {args.nproc} process(es), {args.steps} steps")
        print(f"{'seq_len':>8} {'kernel':>7} {'plain tok/s':>12} {'masked tok/s':>13} {'masked/plain':>13} "
              f"{'plain loss':>11} {'masked loss':>12}")
        for seq_len in args.seq_len:
            plain, plain_loss = train(shards, seq_len, args.steps, args.nproc, kernel=None)
            for kernel in args.kernels:
                masked, masked_loss = train(shards, seq_len, args.steps, args.nproc, kernel=kernel)
                print(f"{seq_len:>8} {kernel:>7} {plain:>12,.0f} {masked:>13,.0f} {masked / plain:>13.2f} "
                      f"{plain_loss:>11.4f} {masked_loss:>12.4f}")


if __name__ == "__main__":
    main()
