"""The loop's own state, saved in every full checkpoint as the `train_state` item."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.loss_scale import DynamicLossScaler


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    loss_scaler: DynamicLossScaler | None = None  # float16 runs only: the scale continues on resume

    def state_dict(self) -> dict:
        state = {"step": self.step, "tokens_seen": self.tokens_seen}
        if self.loss_scaler is not None:
            state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
