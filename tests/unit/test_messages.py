"""One message format for every command (trainer/messages.py): `error: ...`, `warning: ...`,
each once; every warning kept for the run's record."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import pytest

from trainer import messages
from trainer.config.manager import IGNORED_SHOWN, load_config

IGNORED_WARNING = "warning: ignoring options this trainer does not implement"


@pytest.fixture
def fresh(monkeypatch):
    """A process that has printed and kept nothing yet; the root logger restored afterwards."""
    monkeypatch.setattr(messages, "_kept", [])
    monkeypatch.setattr(messages, "_printed", set())
    monkeypatch.setattr(messages, "_dropped", 0)
    monkeypatch.delenv(IGNORED_SHOWN, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def console(**kwargs) -> io.StringIO:
    stream = io.StringIO()
    messages.configure(stream, **kwargs)
    return stream


def test_errors_and_warnings_have_one_format_and_other_lines_stay_as_they_are(fresh):
    out = console()
    log = logging.getLogger("trainer.somewhere")
    log.info("step 1 loss 6.0")
    log.warning("the split is %d sequences", 3)
    log.error("no such file: %s", "x.toml")
    assert out.getvalue().splitlines() == ["step 1 loss 6.0", "warning: the split is 3 sequences",
                                           "error: no such file: x.toml"]


def test_a_rank_log_puts_the_time_first(fresh):
    out = console(timestamps=True)
    logging.getLogger("trainer.train").warning("late")
    logging.getLogger("trainer.train").info("step 2")
    first, second = out.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d warning: late", first) and re.fullmatch(r"\d\d:\d\d:\d\d step 2", second)


def test_a_warning_is_printed_once_and_kept_once_even_after_the_console_changes(fresh):
    out = console()
    log = logging.getLogger("trainer.data")
    log.warning("records skipped")
    later = console(timestamps=True)  # the trainer's second configure, once it trains
    log.warning("records skipped")
    log.info("records skipped")  # an info line is never held back
    assert out.getvalue() == "warning: records skipped\n" and later.getvalue().endswith(" records skipped\n")
    assert later.getvalue().count("records skipped") == 1
    assert messages.kept_warnings() == ["warning: records skipped"]


def test_what_another_process_printed_is_kept_not_printed(fresh):
    out = console()
    logging.getLogger("trainer.config").warning("ignored: [float8]", extra=messages.SHOWN)
    assert out.getvalue() == "" and messages.kept_warnings() == ["warning: ignored: [float8]"]


def test_only_the_trainers_and_the_protocols_warnings_are_kept_and_at_most_a_hundred(fresh):
    console()
    logging.getLogger("torch.distributed").warning("a library's own warning")
    logging.getLogger("protocol.run").error("a run failed")
    for step in range(messages.KEPT_AT_MOST + 5):
        logging.getLogger("trainer.train").warning("step %d: loss scale lowered", step)
    kept = messages.kept_warnings()
    assert kept[0] == "error: a run failed" and kept[1] == "warning: step 0: loss scale lowered"
    assert len(kept) == messages.KEPT_AT_MOST + 1
    assert kept[-1] == f"warning: 6 more warnings not kept (the first {messages.KEPT_AT_MOST} are)"


def test_the_ranks_keep_the_launchers_warning_about_ignored_options_without_printing_it(fresh, monkeypatch):
    out = console()
    monkeypatch.setenv(IGNORED_SHOWN, "1")
    load_config(["--quantize.linear.mx.recipe_name", "mxfp8_cublas"])
    assert out.getvalue() == ""
    [kept] = messages.kept_warnings()
    assert kept.startswith(IGNORED_WARNING) and kept.endswith("command line: --quantize.linear.mx.recipe_name")


def test_the_run_record_holds_the_warnings(fresh, tmp_path):
    from trainer.records import run_meta

    console()
    logging.getLogger("trainer.config").warning("ignored: [float8]", extra=messages.SHOWN)
    run_meta.begin(tmp_path, {"config": {}}, 0)
    assert json.loads((tmp_path / "run_meta.json").read_text())["warnings"] == ["warning: ignored: [float8]"]
    logging.getLogger("trainer.data").warning("late in the run")
    record = run_meta.finish(tmp_path, run_meta.read_record(tmp_path), "completed", 3)
    assert record["warnings"] == ["warning: ignored: [float8]", "warning: late in the run"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


IGNORED = ["--model.flavor", "tiny", "--quantize.linear.mx.recipe_name", "mxfp8_cublas"]


@pytest.mark.parametrize("command", [
    ["trainer.train", "--job.print_config"],
    ["trainer.preflight", "--nproc", "1", "--device", "cpu"],
    # Its rank estimates load the configuration again in processes of their own.
    ["trainer.estimate", "--nproc", "2", "--training.seq_len", "32"],
], ids=["print_config", "preflight", "estimate"])
def test_every_command_prints_the_warning_once_in_the_one_format(command):
    result = run(*command, *IGNORED)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert output.count("ignoring options") == 1 and f"{IGNORED_WARNING} (torchtitan's" in result.stderr
    assert "WARNING" not in output


def test_a_mistake_under_print_config_is_one_error_line():
    result = run("trainer.train", "--job.print_config", "--training.steps", "x")
    assert result.returncode == 2
    assert result.stderr == "error: argument --training.steps: expected an integer, got 'x'\n"
