"""Training on the data sources end to end."""

from __future__ import annotations

from tests.launch import describe, launch, read_metrics
from trainer.data.sources import SyntheticMarkovSource


def test_synthetic_loss_approaches_the_entropy_floor(tmp_path):
    result = launch(1, [
        "--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "16",
        "--training.steps", "200", "--optimizer.lr", "1e-2", "--optimizer.weight_decay", "0",
        "--lr_scheduler.warmup_steps", "10", "--lr_scheduler.decay_ratio", "0.3", "--metrics.log_freq", "50",
        "--metrics.no_enable_tensorboard", "--validation.enable", "--validation.freq", "100",
        "--validation.local_batch_size", "16", "--validation.seq_len", "64", "--validation.steps", "4",
        "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, describe(result)
    floor = SyntheticMarkovSource(vocab_size=256, seed=0).entropy_floor
    assert f"best achievable loss {floor:.4f}" in result.stdout
    records = read_metrics(tmp_path)
    train = [r for r in records if "kind" not in r]
    validation = [r for r in records if r.get("kind") == "validation"]
    assert [r["step"] for r in validation] == [100, 200]
    first, last, val = train[0]["loss"], train[-1]["loss"], validation[-1]["validation/loss"]
    print(f"tiny model, synthetic source, 200 steps: loss {first:.3f} -> {last:.3f} (validation {val:.3f}); "
          f"floor {floor:.3f}; gap {last - floor:.3f} (validation gap {val - floor:.3f}) nats")
    assert first - floor > 3.0
    assert 0 < val - floor < 0.45  # nothing beats the floor; 200 steps get close to it
    assert abs(val - last) < 0.15  # held-out walks of the same chain: no overfitting
