"""`python -m trainer.config.docs > docs/configuration.md`: the configuration reference.

Generated from the dataclass docstrings so the reference cannot drift from the code; a test
checks that the committed file is current.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing

from trainer.config.torchtitan_keys import IGNORED_KEYS, IGNORED_SECTIONS
from trainer.config.job_config import JobConfig
from trainer.config.manager import field_docs, field_types, get_key, leaf_owner, leaf_types, sections, type_name
from trainer.config.ranges import declared
from trainer.config.torchtitan_keys import OWN_KEYS, TORCHTITAN_KEYS, TORCHTITAN_VERSION, table

INTRO = """\
# Configuration reference

A job is configured by a TOML file (`--job.config_file`, looked up in the working directory, then in
`train_configs/`) and command-line overrides. Precedence: command line > TOML > the defaults below.

```
--section.key value      --section.key=value
--section.flag           --section.no_flag        --section.flag=false
--section.items a,b,c
```

Unknown sections and keys, wrong types and invalid values stop the launch with one message naming
the key, where it came from, and what is valid (exit code 2). The *valid* column says what a
number accepts; every float must also be finite (nan and inf are refused) and every integer fit
in 64 bits. `--help` prints this table;
`--job.print_config` prints the resolved configuration as TOML that loads back to the same config
(optional keys left unset, such as `lr_scheduler.total_steps`, are left out: TOML has no null).
torchtitan's configs and command-line flags load as they are: [Coming from
torchtitan](#coming-from-torchtitan) says what each of its keys does here.

This file is generated: `python -m trainer.config.docs > docs/configuration.md`.
"""


TABLE_HEAD = ["| key | type | valid | default | description |", "| --- | --- | --- | --- | --- |"]


def escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    defaults = JobConfig()
    out = [INTRO]
    for section, cls in sections().items():
        out += [f"## [{section}]", "", inspect.cleandoc(cls.__doc__ or ""), "", *TABLE_HEAD]
        for key in leaf_types(cls):
            owner, name = leaf_owner(cls, key)
            out.append(row(owner, name, get_key(getattr(defaults, section), key), field_docs(owner), shown_as=key))
        out.append("")
        for f in dataclasses.fields(cls):
            entry = table_entry_type(field_types(cls)[f.name])
            if entry is not None:
                out += render_entry(f"{section}.{f.name}", entry)
    return render_torchtitan(out)


def table_entry_type(tp) -> type | None:
    """The dataclass of a list-of-tables field, else None."""
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]) else None


def render_entry(name: str, cls: type) -> list[str]:
    out = [f"### [[{name}]]", "", inspect.cleandoc(cls.__doc__ or ""), "", *TABLE_HEAD]
    docs, defaults = field_docs(cls), cls()
    out += [row(cls, f.name, getattr(defaults, f.name), docs) for f in dataclasses.fields(cls)]
    return out + [""]


def row(cls: type, name: str, default, docs: dict[str, str], shown_as: str = "") -> str:
    """One key's table row (named `shown_as`, dotted below a table, else `name`); `valid` is what
    a numeric key accepts (trainer.config.ranges)."""
    rule = declared(cls, name)
    accepted = escape(rule.text(short=True)) if rule is not None else ""
    return (f"| `{shown_as or name}` | {escape(type_name(field_types(cls)[name]))} | {accepted} | `{default!r}` | "
            f"{escape(docs.get(name, ''))} |")


def render_torchtitan(out: list[str]) -> str:
    """The "Coming from torchtitan" table: every torchtitan key and what this trainer does with it."""
    out += ["## Coming from torchtitan", "",
            f"Every key of torchtitan {TORCHTITAN_VERSION}'s configuration, and what this trainer does with it: "
            "*same* (same meaning, default and values), *different* (how), *ignored with a warning* (accepted in "
            "a TOML file and on the command line, named in one warning, without effect; why) or *refused* (an "
            "unknown key, stopping the launch; why). A key that names a table covers every key inside it, as in "
            "torchtitan's `--quantize.linear.mx.recipe_name`. MoE, expert parallelism and MX formats stay out: "
            "this trainer is for Llama.", "",
            "| torchtitan key | here | how, or why |", "| --- | --- | --- |"]
    out += [f"| `{key}` | {state} | {escape(note)} |" for key, state, note in table()]
    def listed(section: str, ignored: str) -> bool:  # a key of v0.2.2's, or a table of them
        return any(key == ignored or key.startswith(f"{ignored}.") for key in TORCHTITAN_KEYS.get(section, ()))

    earlier = [f"`[{s}]`" for s in sorted(IGNORED_SECTIONS) if s not in TORCHTITAN_KEYS]
    earlier += [f"`{section}.{key}`" for section, keys in IGNORED_KEYS.items() for key in sorted(keys)
                if not listed(section, key)]
    out += ["", "Also ignored with a warning, from earlier torchtitan versions: " + ", ".join(earlier) + ".", "",
            "Keys of this trainer that torchtitan does not have: " + ", ".join(f"`{key}`" for key in OWN_KEYS) + "."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
