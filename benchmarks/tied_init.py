"""Initial scale of a tied embedding: loss at the start and after a short training, per std.

    python benchmarks/tied_init.py [--flavor debugmodel] [--steps 150]

A tied model (Llama 3.2) uses the embedding matrix E as its output layer. The hidden state after
the final norm is close to E[t] / rms(E[t]) for the current token t, so t's own logit starts near
dim x std and every other logit has a std of sqrt(dim) x std. The trainer draws E with std
dim^-0.5 (`Transformer.init_std`); this script trains the flavor with its embedding redrawn at
each std in one process (synthetic data, batch 8 x 128, AdamW lr 3e-3 with 20 warmup steps,
clipping at 1) and prints the losses, so that the choice rests on a measurement.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from common import machine, table  # noqa: I001 (sets sys.path)
from trainer.data.synthetic import SyntheticMarkovSource
from trainer.models.llama3 import Transformer, get_flavor


def train(flavor: str, std: float, steps: int) -> list[float]:
    args = get_flavor(flavor)
    args.tie_embeddings, args.max_seq_len = True, 128
    model = Transformer(args)
    model.init_weights(0)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        torch.nn.init.trunc_normal_(model.tok_embeddings.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
    source = SyntheticMarkovSource(vocab_size=args.vocab_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0)
    losses = []
    for step in range(steps):
        rows = torch.from_numpy(source.rows(step * 8, 8, 129).astype("int64"))
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--steps", type=int, default=150)
    a = parser.parse_args()
    torch.manual_seed(0)
    dim, vocab = get_flavor(a.flavor).dim, get_flavor(a.flavor).vocab_size
    rows = []
    for label, std in (("dim^-0.5 (the trainer's)", dim ** -0.5), ("0.02", 0.02), ("1/dim", 1 / dim)):
        losses = train(a.flavor, std, a.steps)
        middle = min(49, a.steps - 1)
        rows.append([label, f"{std:.4f}", f"{losses[0]:.3f}", f"{losses[middle]:.3f}", f"{losses[-1]:.3f}"])
    print(f"{machine()}; {a.flavor} (dim {dim}, vocab {vocab}, ln V = {math.log(vocab):.3f}), tied, {a.steps} steps")
    print(table(["std of E", "value", "loss step 1", f"step {min(50, a.steps)}", f"step {a.steps}"], rows))


if __name__ == "__main__":
    main()
