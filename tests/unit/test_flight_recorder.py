"""comm.trace_buf_size, save_traces_folder and save_traces_file_prefix: what torch's NCCL flight
recorder is told when a CUDA rank creates its process group (trainer/process_setup.py). The dumps
themselves need NCCL and a hung collective: tests/cuda has no such test, so only what the ranks set
is checked here."""

from __future__ import annotations

import pytest

from trainer.config.manager import ConfigError, load_config
from trainer.process_setup import flight_recorder, flight_recorder_env


def test_the_dumps_go_to_the_folder_in_the_dump_folder_with_the_prefix():
    config = load_config(["--job.dump_folder", "/runs/a", "--comm.save_traces_folder", "fr",
                          "--comm.save_traces_file_prefix", "trace_"])
    entries, prefix = flight_recorder(config)
    assert (entries, prefix) == (20000, "/runs/a/fr/trace_")
    assert flight_recorder_env(entries, prefix) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000", "TORCH_FR_BUFFER_SIZE": "20000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/a/fr/trace_", "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/fr/trace_"}
    assert flight_recorder(load_config([]))[1].endswith("outputs/comm_traces/rank_")  # torchtitan's defaults


def test_without_a_trace_buffer_nothing_records_and_nothing_dumps():
    assert flight_recorder_env(0, "/runs/a/comm_traces/rank_") == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                                                                   "TORCH_FR_BUFFER_SIZE": "0"}


def test_a_folder_no_system_call_takes_is_refused_by_name():
    with pytest.raises(ConfigError, match="comm.save_traces_folder: 'a\\\\x00b' holds a NUL character"):
        load_config(["--comm.save_traces_folder", "a\0b"])
