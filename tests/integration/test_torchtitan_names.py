"""torchtitan's debug setup end to end, offline: its kind of test tokenizer folder (a bare
tokenizer.json beside a tokenizer_config.json naming BOS and EOS) and its dataset names c4_test
and c4_validation, read from local copies built here."""

from __future__ import annotations

import gzip
import json
import math

from tests.launch import describe, launch, read_metrics
from tests.unit.test_data_named import c4_records
from tests.unit.test_tokenizer_specials import BOS, EOS, bare_bpe, folder, torchtitan_like_config


def test_debug_model_trains_on_c4_test_and_validates_on_c4_validation(tmp_path, monkeypatch):
    spec, n = bare_bpe()
    tokenizer = folder(tmp_path / "tokenizer", spec, {"tokenizer_config.json": torchtitan_like_config(n)})
    (tmp_path / "c4_test").mkdir()
    (tmp_path / "c4_test" / "data.json").write_text("".join(json.dumps(r) + "\n" for r in c4_records("train", 300)))
    (tmp_path / "c4" / "en").mkdir(parents=True)
    with gzip.open(tmp_path / "c4" / "en" / "c4-validation.00000-of-00001.json.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in c4_records("validation", 50))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    job = ["--model.flavor", "debugmodel", "--model.hf_assets_path", str(tokenizer.parent),
           "--training.dataset", "c4_test", "--training.dataset_path", str(tmp_path / "c4_test"),
           "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2",
           "--validation.enable", "--validation.dataset", "c4_validation", "--validation.freq", "2",
           "--validation.steps", "1", "--validation.local_batch_size", "2", "--validation.global_batch_size", "2",
           "--metrics.log_freq", "1",
           "--metrics.no_enable_tensorboard", "--job.dump_folder", str(tmp_path / "run")]
    missing = launch(1, job)  # no copy of C4's validation split, the hub off, nothing cached
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: validation.dataset_path: dataset 'c4_validation' is streamed from the "
                                     "Hugging Face hub (allenai/c4, config en, split validation), which "
                                     "HF_HUB_OFFLINE=1 turns off"), describe(missing)
    result = launch(1, [*job, "--validation.dataset_path", str(tmp_path / "c4")])
    assert result.returncode == 0, describe(result)
    for token, role, token_id in ((BOS, "BOS", n + 4), (EOS, "EOS", n + 5)):  # said once, by the data pipeline
        assert result.stdout.count(f"added '{token}' ({role})") == 1, describe(result)
        assert f"added '{token}' ({role}) to {tokenizer} at id {token_id}: " in result.stdout
    records = read_metrics(tmp_path / "run")
    train = [r for r in records if "kind" not in r]
    validation = [r for r in records if r.get("kind") == "validation"]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in validation] == [2]
    # At init the loss is about ln V + 0.99^2 / 2 = 8.11 for the debug model's 2048 rows (README), in
    # expectation over the initial weights: on one draw the few, frequent target tokens of a batch
    # meet fixed random output rows, which moves the first loss by about 0.2 (debug.seed 0-5 on this
    # batch: 7.69, 8.11, 8.09, 8.08, 8.01, 8.37). The bound is three times that spread.
    assert abs(train[0]["loss"] - (math.log(2048) + 0.99 ** 2 / 2)) < 0.6
    assert validation[0]["validation/loss"] < train[0]["loss"]
