"""Dynamic loss scaling for float16 compute.

The loss is divided by the global target count before backward (ARCHITECTURE invariant 2), so
the gradient of a logit is (softmax - onehot) / N: at a 128k vocabulary and 65k tokens a step,
almost every one of them is below float16's smallest subnormal (6e-8) and backward in float16
rounds it to zero. bfloat16 has float32's exponent range and does not need this.

The loss is multiplied by a scale S before backward, so float16 carries S times the gradients;
the float32 gradients FSDP reduces are divided by S again before the norm, clipping and the
optimizer. When S is too large, some gradient overflows to inf/NaN: the global gradient norm
(one all-reduce over every rank, trainer.optim.clip_grad_norm) is then non-finite on every rank
at once, every rank skips that optimizer step and halves S. After `growth_interval` steps without
an overflow, S doubles, so it stays near the largest value that fits.

A skipped step still counts as a training step: the data advances and the learning-rate schedule
moves on, so step numbers, data and schedule stay those of the run without skips.
"""

from __future__ import annotations

import torch

from trainer.local_shards import scale_gradients_


class LossScaleError(RuntimeError):
    """Gradients overflow even at the smallest allowed scale: not a float16 range problem."""


class DynamicLossScaler:
    """The scale, its update rule and the counts the metrics and checkpoints keep."""

    def __init__(self, initial: float, growth_interval: int, minimum: float):
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self.minimum = float(minimum)
        self.steps_since_overflow = 0
        self.skipped_steps = 0  # over the whole run, resumes included

    def update(self, finite: bool, step: int) -> None:
        """After each step's gradients are known: back off on an overflow, grow after a quiet window."""
        if finite:
            self.steps_since_overflow += 1
            if self.steps_since_overflow >= self.growth_interval:
                self.scale *= 2.0
                self.steps_since_overflow = 0
            return
        if self.scale <= self.minimum:
            raise LossScaleError(
                f"step {step}: the gradients are not finite at the smallest loss scale "
                f"(training.loss_scale_min = {self.minimum:g}); the loss has diverged, or values exceed float16's "
                "range at any scale (lower optimizer.lr, check the data, or train in bfloat16)")
        self.scale = max(self.scale / 2.0, self.minimum)
        self.steps_since_overflow = 0
        self.skipped_steps += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "steps_since_overflow": self.steps_since_overflow,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.steps_since_overflow = int(state["steps_since_overflow"])
        self.skipped_steps = int(state["skipped_steps"])


@torch.no_grad()
def unscale_gradients(parameters, scale: float) -> None:
    """Divide every gradient by the loss scale, in place (inf and NaN stay non-finite).

    Multiplying by 1/S is exact: S is a power of two."""
    scale_gradients_([p.grad for p in parameters if p.grad is not None], 1.0 / scale)


def build_loss_scaler(config, param_dtype: torch.dtype) -> DynamicLossScaler | None:
    """A scaler when the model computes in float16, else None (no scaling, the code path of float32/bfloat16)."""
    if param_dtype != torch.float16:
        return None
    t = config.training
    return DynamicLossScaler(t.loss_scale_initial, t.loss_scale_growth_interval, t.loss_scale_min)
