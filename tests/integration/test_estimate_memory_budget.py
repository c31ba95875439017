"""trainer.estimate with the compiler's memory budget (activation_checkpoint.mode memory_budget),
which eager code cannot run: estimated at the budget's share of the way from full checkpointing to
none, where it was estimated as no checkpointing and a strict gate refused jobs that fit. Five
estimates of the debug model at 2,048 tokens (about 11 s)."""

from __future__ import annotations

from tests.unit.test_estimate import DEBUG
from trainer.estimate.__main__ import main
from trainer.estimate.job import estimate_kinds, estimated_config
from trainer.estimate.rank import rank_kinds
from trainer.preflight.checks import plan_layout


def test_the_compilers_memory_budget_is_estimated_at_its_share_between_full_and_no_checkpointing(capsys):
    job = [*DEBUG, "--training.seq_len", "2048", "--training.local_batch_size", "1", "--compile.enable"]
    config, _ = estimated_config(job)
    kinds = rank_kinds(plan_layout(config, 2).dims, None)
    full, none, budget = (estimate_kinds([*job, "--activation_checkpoint.mode", *mode], 2, kinds, steps=1)[0]
                          for mode in (["full"], ["none"], ["memory_budget", "--activation_checkpoint.memory_budget",
                                                            "0.25"]))
    assert full.step_peak.total < budget.step_peak.total < none.step_peak.total
    assert budget.step_peak.activations == round(full.step_peak.activations + 0.25 * (none.step_peak.activations
                                                                                      - full.step_peak.activations))
    # A device between the budget's peak and no checkpointing's: the budget fits, --strict passes.
    memory = round((budget.step_peak.total + none.step_peak.total) / 2 / 0.9)
    assert main(["--nproc", "2", "--device-memory", str(memory), "--strict", "--no-changes", *job,
                 "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.25"]) == 0
    assert "estimated between AC full (0) and none (1) at the budget" in capsys.readouterr().out
