"""job.save_config_file: the resolved configuration written into the dump folder, never over a
file this trainer did not write."""

from __future__ import annotations

import pytest

from trainer.config.manager import ConfigError, load_config, to_toml
from trainer.config.saved_config import HEADER, check_saved_config_file, write_config_file
from trainer.preflight.checks import plan_run


def config_in(tmp_path, name="config.toml", *extra):
    return load_config(["--job.dump_folder", str(tmp_path / "run"), "--job.save_config_file", name,
                        "--training.steps", "7", "--lr_scheduler.total_steps", "20", *extra])


def test_the_resolved_configuration_is_written_and_loads_back(tmp_path):
    config = config_in(tmp_path, "configs/job.toml")
    path = write_config_file(config)
    assert path == tmp_path / "run" / "configs" / "job.toml"
    text = path.read_text()
    assert text == f"{HEADER}\n{to_toml(config)}"  # what --job.print_config prints, below its own first line
    again = load_config(["--job.config_file", str(path)])
    again.job.config_file = config.job.config_file
    assert again == config
    assert [p.name for p in path.parent.iterdir()] == ["job.toml"]  # nothing left half written


def test_a_later_start_replaces_the_file_it_wrote(tmp_path):
    write_config_file(config_in(tmp_path))
    config = config_in(tmp_path, "config.toml", "--training.steps", "9")
    plan_run(config, 1)  # the preflight accepts the trainer's own file
    path = write_config_file(config)
    assert "steps = 9" in path.read_text()


def test_a_file_the_trainer_did_not_write_is_refused_before_launch_and_kept(tmp_path):
    config = config_in(tmp_path, "notes.toml")
    own = tmp_path / "run" / "notes.toml"
    own.parent.mkdir(parents=True)
    own.write_text("# my notes\n[training]\nsteps = 1\n")
    with pytest.raises(ConfigError) as info:
        plan_run(config, 1)
    assert str(info.value) == (f"job.save_config_file: {own} exists and was not written by this trainer (it does not "
                               "start with the line it writes), so it is not replaced; move it away, or choose another "
                               "name")
    with pytest.raises(ConfigError, match="was not written by this trainer"):
        write_config_file(config)  # the trainer checks again right before writing
    assert own.read_text() == "# my notes\n[training]\nsteps = 1\n"


def test_a_folder_under_that_name_is_refused(tmp_path):
    config = config_in(tmp_path, "config.toml")
    (tmp_path / "run" / "config.toml").mkdir(parents=True)
    with pytest.raises(ConfigError, match="config.toml exists and is not a file; choose another name"):
        check_saved_config_file(config)


def test_nothing_is_written_without_the_key(tmp_path):
    config = load_config(["--job.dump_folder", str(tmp_path / "run")])
    check_saved_config_file(config)
    assert write_config_file(config) is None and not (tmp_path / "run").exists()


def test_a_link_under_that_name_is_refused_and_what_it_points_at_is_kept(tmp_path):
    """Even a link to a file this trainer wrote: replacing the link, or writing through it, would
    change another run's file."""
    elsewhere = tmp_path / "other-run" / "config.toml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(f"{HEADER}\n[training]\nsteps = 1\n")
    config = config_in(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="config.toml is a symbolic link, which the trainer does not replace"):
        plan_run(config, 1)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        write_config_file(config)
    assert (tmp_path / "run" / "config.toml").is_symlink()
    assert elsewhere.read_text() == f"{HEADER}\n[training]\nsteps = 1\n"


@pytest.mark.parametrize("beside", [".config.toml.tmp", ".config.toml.partial"])
def test_a_link_at_the_name_written_beside_is_not_followed(tmp_path, beside):
    """The file is written beside and renamed: a link left (or put) at that name is replaced,
    never written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / beside).symlink_to(victim)
    path = write_config_file(config_in(tmp_path))
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text().startswith(HEADER)
