"""Per-module fingerprints (trainer/fingerprints.py) in one process: each figure against its
definition computed directly from the model, the float16 loss scale taken out, the steps chosen,
and the file kept with metrics.jsonl on resume. Their agreement across parallel layouts is checked
by tests/integration/test_parallel_parity.py."""

from __future__ import annotations

import json

import pytest
import torch

from trainer import run_record
from trainer.config.manager import ConfigError, load_config, with_default_config
from trainer.fingerprints import FingerprintRecorder, is_recorded, parameter_names
from trainer.loss import cross_entropy_sum
from trainer.models.llama3 import Transformer, get_flavor
from trainer.optim import NormReduction


def tiny_model() -> Transformer:
    args = get_flavor("tiny")
    model = Transformer(args)
    model.init_weights(seed=3)
    return model


def train_step(model: Transformer, recorder: FingerprintRecorder, tokens: torch.Tensor, scale: float | None,
               step: int = 1) -> None:
    """One step as the trainer takes it, over two microbatches, with the loss times `scale`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder.start()
    for rows in tokens.split(2):
        loss = cross_entropy_sum(model(rows[:, :-1]), rows[:, 1:]) / tokens[:, 1:].numel()
        (loss * (scale or 1.0)).backward()
    recorder.gradients(scale)
    for p in model.parameters():
        p.grad /= scale or 1.0
    optimizer.step()
    recorder.finish(step, skipped=False)


def record(tmp_path, scale: float | None) -> tuple[dict, dict]:
    """(the line the recorder wrote, the same figures computed directly) for one step."""
    torch.manual_seed(0)
    model = tiny_model()
    tokens = torch.randint(0, model.args.vocab_size, (4, 17))
    outputs, grads = {}, {}

    def keep(name, output):  # the block outputs and their gradients, whole
        outputs.setdefault(name, []).append(output.detach())
        output.register_hook(lambda g: grads.setdefault(name, []).append(g / (scale or 1.0)))

    recorder = FingerprintRecorder(model, [model], NormReduction(), parameter_names(model.args), model.args.n_layers,
                                   first=4, every=0, folder=tmp_path, device=torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    probe = recorder.probe
    model.block_probe = lambda name, output: (keep(name, output), probe(name, output))
    train_step(model, recorder, tokens, scale)
    line = json.loads((tmp_path / "fingerprints.jsonl").read_text())
    direct = {
        "grad_norm": {n: p.grad.double().norm().item() for n, p in model.named_parameters()},
        "update_norm": {n: (p.detach() - before[n]).double().norm().item() for n, p in model.named_parameters()},
        "param_norm": {n: p.detach().double().norm().item() for n, p in model.named_parameters()},
        "output_rms": {n: torch.cat(v).double().square().mean().sqrt().item() for n, v in outputs.items()},
        "grad_rms": {n: torch.cat(v).double().square().mean().sqrt().item() for n, v in grads.items()},
    }
    return line, direct


@pytest.mark.parametrize("scale", [None, 1024.0])
def test_each_figure_is_its_definition(tmp_path, scale):
    """Gradient, update and value norms per parameter; RMS of each block's output and of the
    gradient reaching it over both microbatches; under a float16 loss scale, the unscaled figures."""
    line, direct = record(tmp_path, scale)
    assert line["step"] == 1 and line["skipped"] is False
    assert list(line["grad_norm"]) == [name for name, _ in tiny_model().named_parameters()]
    assert list(line["output_rms"]) == ["0", "1", "2", "3"]
    for quantity, expected in direct.items():
        assert line[quantity].keys() == expected.keys(), quantity
        for entry, value in expected.items():
            assert value > 0, (quantity, entry)
            assert line[quantity][entry] == pytest.approx(value, rel=1e-6), (quantity, entry)


def test_the_probe_records_only_a_recorded_training_pass(tmp_path):
    model = tiny_model()
    recorder = FingerprintRecorder(model, [model], NormReduction(), parameter_names(model.args), model.args.n_layers,
                                   first=1, every=0, folder=tmp_path, device=torch.device("cpu"))
    tokens = torch.randint(0, model.args.vocab_size, (2, 9))
    model(tokens).sum().backward()  # not started: nothing counted
    assert recorder.probe.sums.abs().sum() == 0
    recorder.start()
    with torch.no_grad():  # an evaluation pass inside a recorded step counts nothing either
        model(tokens)
    assert recorder.probe.sums.abs().sum() == 0


def test_a_tied_model_names_its_one_weight_once():
    args = get_flavor("tiny")
    tied = type(args)(**{**args.__dict__, "tie_embeddings": True})
    names = parameter_names(tied)
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("first, every, recorded", [
    (4, 50, [1, 2, 3, 4, 50, 100]), (0, 30, [30, 60, 90]), (2, 0, [1, 2]), (0, 0, [])])
def test_recorded_steps(first, every, recorded):
    assert [s for s in range(1, 101) if is_recorded(s, first, every)] == recorded


def test_a_resume_keeps_the_fingerprints_of_the_steps_it_keeps(tmp_path):
    """fingerprints.jsonl follows metrics.jsonl: the lines after the resumed step move to previous/."""
    for name in run_record.STEP_FILES:
        (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    moved = run_record.drop_metrics_after(tmp_path, 2)
    for name in run_record.STEP_FILES:
        assert [json.loads(line)["step"] for line in (tmp_path / name).open()] == [1, 2]
        assert [json.loads(line)["step"] for line in (moved / name).open()] == [3, 4]
    run_record.archive(tmp_path)  # a new run in the folder: both go with the record
    assert not any((tmp_path / name).exists() for name in run_record.STEP_FILES)


@pytest.mark.parametrize("key, value, message", [
    ("metrics.fingerprint_first", "-1", "metrics.fingerprint_first: must be >= 0, got -1"),
    ("metrics.fingerprint_every", "-5", "metrics.fingerprint_every: must be >= 0"),
])
def test_bad_steps_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(with_default_config([f"--{key}", value]))


def test_off_by_default():
    config = load_config(with_default_config([]))
    assert config.metrics.fingerprints is False


def test_fingerprints_that_record_no_step_are_refused():
    with pytest.raises(ConfigError, match="no step is recorded"):
        load_config(with_default_config(["--metrics.fingerprints", "--metrics.fingerprint_first", "0",
                                         "--metrics.fingerprint_every", "0"]))
