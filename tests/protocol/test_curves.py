"""Reading loss curves from metrics.jsonl and TensorBoard event folders."""

from __future__ import annotations

import json
import math

import pytest

from protocol.verdict.curves import Curve, CurveError, read_curve


def write_jsonl(path, records, extra_lines=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def step_record(step, loss, grad_norm=1.0):
    """A record shaped like trainer/metrics/step_log.py writes it."""
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3, "tokens": 64 * step,
            "tokens_per_s": 100.0, "tflops": 0.1, "mfu": None, "memory": {"peak_rss_gib": 1.0},
            "time": 1.7e9 + step, "step_time_s": 0.5}


# ---------------------------------------------------------------- metrics.jsonl
def test_dump_folder_and_file_give_the_same_curve(tmp_path):
    run = tmp_path / "fsdp8"
    write_jsonl(run / "metrics.jsonl", [step_record(s, 5.0 - 0.01 * s, 2.0 + s) for s in (1, 2, 3)])
    from_folder = read_curve(run)
    from_file = read_curve(run / "metrics.jsonl")
    assert from_folder == from_file
    assert from_folder.name == "fsdp8"
    assert from_folder.steps == [1, 2, 3]
    assert from_folder.loss == pytest.approx([4.99, 4.98, 4.97])
    assert from_folder.grad_norm == pytest.approx([3.0, 4.0, 5.0])
    assert from_folder.source == str(run / "metrics.jsonl")
    assert read_curve(run, name="control").name == "control"


def test_resumed_run_last_value_wins_and_steps_are_sorted(tmp_path):
    records = [step_record(1, 5.0), step_record(2, 4.9), step_record(3, 4.8),
               # resumed from the step-2 checkpoint: step 3 logged again, then 4
               step_record(3, 4.7), step_record(4, 4.6)]
    path = write_jsonl(tmp_path / "run" / "metrics.jsonl", records)
    curve = read_curve(path)
    assert curve.steps == [1, 2, 3, 4]
    assert curve.loss == pytest.approx([5.0, 4.9, 4.7, 4.6])

    unsorted = write_jsonl(tmp_path / "u" / "metrics.jsonl", [step_record(3, 3.0), step_record(1, 1.0)])
    assert read_curve(unsorted).steps == [1, 3]
    assert read_curve(unsorted).loss == [1.0, 3.0]


def test_validation_records_are_skipped_and_selectable(tmp_path):
    records = [step_record(1, 5.0), {"step": 1, "kind": "validation", "validation/loss": 5.5, "time": 0.0},
               step_record(2, 4.0), {"step": 2, "kind": "validation", "validation/loss": 4.5, "time": 0.0}]
    path = write_jsonl(tmp_path / "run" / "metrics.jsonl", records)
    assert read_curve(path).loss == [5.0, 4.0]
    val = read_curve(path, loss_tag="validation/loss")
    assert val.steps == [1, 2] and val.loss == [5.5, 4.5]
    assert val.grad_norm is None
    # the TensorBoard name of the training loss means the "loss" key
    assert read_curve(path, loss_tag="loss_metrics/global_avg_loss").loss == [5.0, 4.0]


def test_diverged_run_reads_nan_and_missing_grad_norm_is_none(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 1, "loss": 5.0}\n\n{"step": 2, "loss": NaN}\n', encoding="utf-8")
    curve = read_curve(path)
    assert curve.steps == [1, 2]
    assert curve.loss[0] == 5.0 and math.isnan(curve.loss[1])
    assert curve.grad_norm is None


def test_missing_path_is_named(tmp_path):
    with pytest.raises(CurveError, match="nowhere: no such file or folder"):
        read_curve(tmp_path / "nowhere")


def test_folder_without_metrics_or_events(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CurveError, match=r"empty: neither metrics\.jsonl nor TensorBoard event files"):
        read_curve(tmp_path / "empty")


def test_bad_json_line_names_the_line_number(tmp_path):
    path = write_jsonl(tmp_path / "run" / "metrics.jsonl", [step_record(1, 5.0), step_record(2, 4.0)],
                       extra_lines=['{"step": 3, "loss": 4.'])
    with pytest.raises(CurveError) as info:
        read_curve(path)
    assert f"{path}:3: not valid JSON" in str(info.value)


def test_record_without_loss_or_integer_step(tmp_path):
    path = write_jsonl(tmp_path / "a" / "metrics.jsonl", [step_record(1, 5.0), {"step": 2, "grad_norm": 1.0}])
    with pytest.raises(CurveError, match=r"metrics\.jsonl:2: 'loss' must be a number, got None"):
        read_curve(path)
    path = write_jsonl(tmp_path / "b" / "metrics.jsonl", [{"step": "one", "loss": 5.0}])
    with pytest.raises(CurveError, match=r"metrics\.jsonl:1: 'step' must be an integer"):
        read_curve(path)
    path = write_jsonl(tmp_path / "c" / "metrics.jsonl", [[1, 2]])
    with pytest.raises(CurveError, match=r"metrics\.jsonl:1: expected a JSON object"):
        read_curve(path)


def test_unknown_jsonl_key_lists_the_keys(tmp_path):
    path = write_jsonl(tmp_path / "run" / "metrics.jsonl", [step_record(1, 5.0)])
    with pytest.raises(CurveError, match=r"no record has the key 'val_loss'; keys found: .*grad_norm.*loss"):
        read_curve(path, loss_tag="val_loss")


def test_empty_metrics_file(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("", encoding="utf-8")
    with pytest.raises(CurveError, match="no training steps logged"):
        read_curve(path)


def test_curve_checks_its_lengths_and_order():
    with pytest.raises(ValueError, match="3 steps but 2 loss values"):
        Curve("x", [1, 2, 3], [1.0, 2.0], None, "here")
    with pytest.raises(ValueError, match="strictly increasing"):
        Curve("x", [2, 1], [1.0, 2.0], None, "here")


# ---------------------------------------------------------------- TensorBoard
@pytest.fixture(scope="module")
def summary_writer():
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def write_events(writer_cls, folder, scalars: dict[str, list[tuple[int, float]]], walltime0=1000.0, **kwargs):
    writer = writer_cls(log_dir=str(folder))
    for tag, points in scalars.items():
        for i, (step, value) in enumerate(points):
            writer.add_scalar(tag, value, step, walltime=walltime0 + i, **kwargs)
    writer.close()


def test_tensorboard_tags_of_this_trainer(tmp_path, summary_writer):
    # the layout trainer/metrics/step_log.py writes: <dump_folder>/tb/<stamp>/events...
    run = tmp_path / "tp2"
    write_events(summary_writer, run / "tb" / "20240101-000000", {
        "loss_metrics/global_avg_loss": [(1, 5.0), (2, 4.5), (3, 4.25)],
        "grad_norm": [(1, 2.0), (2, 1.5), (3, 1.25)],
        "lr": [(1, 1e-3), (2, 1e-3), (3, 1e-3)],
    })
    curve = read_curve(run)
    assert curve.name == "tp2"
    assert curve.steps == [1, 2, 3]
    assert curve.loss == pytest.approx([5.0, 4.5, 4.25])
    assert curve.grad_norm == pytest.approx([2.0, 1.5, 1.25])
    assert curve.source == str(run)


def test_tensorboard_other_trainer_custom_tags_and_resume(tmp_path, summary_writer):
    # a run logging torchtitan's loss tag, restarted into a second folder that re-logs step 3
    run = tmp_path / "other"
    write_events(summary_writer, run / "first", {"loss_metrics/global_avg_loss": [(1, 5.0), (2, 4.0), (3, 3.0)],
                                                 "train/gnorm": [(1, 9.0), (2, 8.0), (3, 7.0)]})
    write_events(summary_writer, run / "second", {"loss_metrics/global_avg_loss": [(3, 3.5), (4, 2.5)],
                                                  "train/gnorm": [(3, 6.5), (4, 5.5)]}, walltime0=2000.0)
    curve = read_curve(run)
    assert curve.steps == [1, 2, 3, 4]
    assert curve.loss == pytest.approx([5.0, 4.0, 3.5, 2.5])
    assert curve.grad_norm is None  # no default grad-norm tag present
    tagged = read_curve(run, grad_norm_tag="train/gnorm")
    assert tagged.grad_norm == pytest.approx([9.0, 8.0, 6.5, 5.5])


def test_tensorboard_given_tag_overrides_and_tensor_scalars(tmp_path, summary_writer):
    run = tmp_path / "tf2"
    # new_style writes 0-d tensors, as TF2-style writers do
    write_events(summary_writer, run, {"my/loss": [(10, 3.0), (20, 2.0)], "loss": [(10, 9.0), (20, 9.0)]},
                 new_style=True)
    assert read_curve(run).loss == pytest.approx([9.0, 9.0])  # the bare "loss" default
    curve = read_curve(run, loss_tag="my/loss")
    assert curve.steps == [10, 20]
    assert curve.loss == pytest.approx([3.0, 2.0])


def test_tensorboard_unknown_tag_lists_available_tags(tmp_path, summary_writer):
    run = tmp_path / "run"
    write_events(summary_writer, run, {"lr": [(1, 0.1)], "throughput/tps": [(1, 10.0)]})
    with pytest.raises(CurveError) as info:
        read_curve(run)
    message = str(info.value)
    assert str(run) in message
    assert "loss_metrics/global_avg_loss" in message
    assert "tags found: lr, throughput/tps" in message
    with pytest.raises(CurveError, match="loss tag 'nope' not found; tags found: lr, throughput/tps"):
        read_curve(run, loss_tag="nope")


def test_tensorboard_per_rank_folders_read_one_rank(tmp_path, summary_writer):
    stamp = tmp_path / "run" / "tb" / "20240101-000000"
    write_events(summary_writer, stamp / "rank_0", {"loss_metrics/global_avg_loss": [(1, 5.0), (2, 4.0)]})
    write_events(summary_writer, stamp / "rank_1", {"loss_metrics/global_avg_loss": [(1, 7.0), (2, 6.0)]},
                 walltime0=5000.0)
    assert read_curve(tmp_path / "run").loss == [5.0, 4.0]
