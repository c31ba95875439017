"""The trainer's Llama trained by a plain hand-written loop: the floor of framework overhead.

    python benchmarks/plain_loop.py --shape shape.json --seq-len 2048 --local-batch 4 --steps 30
        [--compile] [--ac none|selective|full] [--warmup 10] [--device cuda]

No process group, no FSDP, no data loader, no metrics: one model in float32 on one device, its
forward under torch.autocast(bfloat16), a cross-entropy in float32, AdamW (fused where the device
has it), gradient clipping at 1.0, random token batches made on the device. Activation
checkpointing: selective checkpoints every second block (the trainer's and torchtitan's
selective_ac_option "2"), full every block. --compile compiles each block and the loss.

It prints one JSON line: tokens/s per device over the steps after --warmup (timed on the host
around a device synchronization), the losses and the allocator's peak memory. shape.json holds
trainer.models.llama3.args.LlamaModelArgs fields (benchmarks/side_by_side.py writes it).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common import synchronize  # noqa: I001 (sets sys.path)
from trainer.models.llama3.args import LlamaModelArgs
from trainer.models.llama3.model import Transformer


def build(shape: dict, seq_len: int, device: torch.device) -> Transformer:
    args = LlamaModelArgs(**{**shape, "max_seq_len": seq_len})
    with torch.device(device):
        model = Transformer(args)
    model.init_weights(seed=0, device=device)
    return model


def wrap_blocks(model: Transformer, ac: str, compile_blocks: bool) -> None:
    """Checkpoint every block (full) or every second one (selective); compile each block."""
    for index, (name, block) in enumerate(list(model.layers.items())):
        forward = torch.compile(block) if compile_blocks else block
        if ac == "full" or (ac == "selective" and index % 2 == 1):
            model.layers[name] = Checkpointed(forward)
        elif compile_blocks:
            model.layers[name] = forward


class Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, help="JSON file of LlamaModelArgs fields")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--local-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compilation, allocator)")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build(json.load(open(args.shape)), args.seq_len, device)
    wrap_blocks(model, args.ac, args.compile)
    loss_fn = torch.compile(cross_entropy) if args.compile else cross_entropy
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    vocab = model.args.vocab_size
    losses, began = [], None
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            synchronize(device)
            began = time.perf_counter()
        tokens = torch.randint(0, vocab, (args.local_batch, args.seq_len + 1), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = loss_fn(logits, tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    synchronize(device)
    seconds = time.perf_counter() - began
    timed = args.steps - args.warmup
    result = {"system": "plain loop", "tokens_per_s": timed * args.local_batch * args.seq_len / seconds,
              "step_time_s": seconds / timed, "losses": [round(float(x), 4) for x in losses],
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type}
    if device.type == "cuda":
        result["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["max_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
