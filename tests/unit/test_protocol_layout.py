"""The layout of the protocol package: a plan flows plan -> run -> verdict -> report, never back.

Every module under protocol/ is parsed (not imported) and every import it makes, at module level
or inside a function, is checked:

- layering: protocol.plan imports none of run, verdict, report; protocol.run only plan;
  protocol.verdict only plan; protocol.report plan and verdict; protocol.cli and
  protocol.__main__ tie them together and may import any;
- every module belongs to one of those (no flat modules beside them);
- no import cycle between modules;
- every package's __init__.py is a docstring saying what it owns, and nothing else;
- no module is longer than MAX_LINES.

The same checks run on small made-up packages that break each rule, so a check that stopped
finding anything would fail here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "protocol"
MAX_LINES = 400
# Which layers a module of each layer may import (its own included); "top" may import any.
ALLOWED = {
    "plan": {"plan"},
    "run": {"plan", "run"},
    "verdict": {"plan", "verdict"},
    "report": {"plan", "verdict", "report"},
}
TOP = {"protocol", "protocol.cli", "protocol.__main__"}


def read_package(root: Path) -> dict[str, str]:
    """Dotted module name -> source, for every .py file under `root` (a package named root.name)."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def is_package(name: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(name + ".") for other in sources)


def imports(name: str, source: str, sources: dict[str, str]) -> set[str]:
    """The modules of the package that `name` imports anywhere in its source, each resolved to the
    most specific module there is (`from protocol.plan import model` -> protocol.plan.model)."""
    top = name.split(".")[0]
    package = name if is_package(name, sources) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != top:
                continue
            while target not in sources and "." in target:
                target = target.rpartition(".")[0]
            if target != name:
                found.add(target)
    return found


def layer(name: str) -> str | None:
    """plan, run, verdict or report; "top" for the package itself and its command line; None for
    a module that belongs to no layer."""
    if name in TOP:
        return "top"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def layering_problems(sources: dict[str, str]) -> list[str]:
    found = []
    for name, source in sources.items():
        own = layer(name)
        if own is None:
            found.append(f"{name}: belongs to no layer; put it in one of protocol.{', protocol.'.join(ALLOWED)}")
            continue
        if own == "top":
            continue
        for target in sorted(imports(name, source, sources)):
            theirs = layer(target)
            if theirs != "top" and theirs not in ALLOWED[own]:
                found.append(f"{name} imports {target}: protocol.{own} may import only "
                             f"{', '.join(f'protocol.{a}' for a in sorted(ALLOWED[own]))}")
            elif theirs == "top":
                found.append(f"{name} imports {target}: only the command line ties the layers together")
    return found


def cycles(sources: dict[str, str]) -> list[list[str]]:
    """Every import cycle between modules, each once, as the modules in import order."""
    graph = {name: sorted(imports(name, source, sources)) for name, source in sources.items()}
    found, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = path[path.index(name):]
            turned = min(cycle[i:] + cycle[:i] for i in range(len(cycle)))
            if turned not in found:
                found.append(turned)
            return
        if name in done:
            return
        for target in graph.get(name, []):
            visit(target, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])
    return found


def init_problems(sources: dict[str, str]) -> list[str]:
    found = []
    for name, source in sources.items():
        if not is_package(name, sources):
            continue
        tree = ast.parse(source)
        if not (ast.get_docstring(tree) or "").strip():
            found.append(f"{name}/__init__.py: no docstring saying what the package owns")
        if len(tree.body) > 1:
            found.append(f"{name}/__init__.py: holds more than its docstring; import from the modules themselves")
    return found


def long_modules(sources: dict[str, str]) -> list[str]:
    return [f"{name}: {len(source.splitlines())} lines (at most {MAX_LINES}); split it along a seam"
            for name, source in sources.items() if len(source.splitlines()) > MAX_LINES]


# ---------------------------------------------------------------------------------------------
# The protocol package


def test_the_layers_import_only_downwards():
    assert layering_problems(read_package(ROOT)) == []


def test_no_module_imports_itself_back():
    assert cycles(read_package(ROOT)) == []


def test_every_package_says_what_it_owns():
    sources = read_package(ROOT)
    assert {"protocol.plan", "protocol.run", "protocol.verdict", "protocol.report"} <= set(sources)
    assert init_problems(sources) == []


def test_no_module_is_too_long():
    assert long_modules(read_package(ROOT)) == []


# ---------------------------------------------------------------------------------------------
# The checks catch what they are for


def made_up(tmp_path: Path, files: dict[str, str]) -> dict[str, str]:
    root = tmp_path / "protocol"
    base = {"__init__.py": '"""The package."""\n', "cli.py": "from protocol.report import markdown\n",
            "plan/__init__.py": '"""Plans."""\n', "plan/model.py": "", "run/__init__.py": '"""Runs."""\n',
            "run/local.py": "from protocol.plan.model import Plan\n", "verdict/__init__.py": '"""Verdicts."""\n',
            "verdict/compare.py": "", "report/__init__.py": '"""Reports."""\n',
            "report/markdown.py": "from protocol.verdict import compare\n"}
    for relative, text in {**base, **files}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_package(root)


def test_a_clean_made_up_package_passes(tmp_path):
    sources = made_up(tmp_path, {})
    assert (layering_problems(sources), cycles(sources), init_problems(sources), long_modules(sources)) == \
        ([], [], [], [])


def test_an_import_back_up_the_pipeline_is_caught_even_inside_a_function(tmp_path):
    sources = made_up(tmp_path, {"plan/model.py": "def f():\n    from protocol.run.local import run\n",
                                 "verdict/compare.py": "from ..run import local\n",
                                 "run/local.py": "import protocol.report.markdown\n"})
    assert layering_problems(sources) == [
        "protocol.plan.model imports protocol.run.local: protocol.plan may import only protocol.plan",
        "protocol.run.local imports protocol.report.markdown: protocol.run may import only protocol.plan, "
        "protocol.run",
        "protocol.verdict.compare imports protocol.run.local: protocol.verdict may import only protocol.plan, "
        "protocol.verdict"]


def test_a_module_outside_the_layers_or_importing_the_command_line_is_caught(tmp_path):
    sources = made_up(tmp_path, {"compare.py": "", "verdict/compare.py": "from protocol import cli\n"})
    assert layering_problems(sources) == [
        "protocol.compare: belongs to no layer; put it in one of protocol.plan, protocol.run, protocol.verdict, "
        "protocol.report",
        "protocol.verdict.compare imports protocol.cli: only the command line ties the layers together"]


def test_a_cycle_is_caught(tmp_path):
    sources = made_up(tmp_path, {"plan/model.py": "from protocol.plan.sweeps import Sweep\n",
                                 "plan/sweeps.py": "def f():\n    from protocol.plan import model\n"})
    assert cycles(sources) == [["protocol.plan.model", "protocol.plan.sweeps"]]


def test_an_init_without_docstring_or_with_code_is_caught(tmp_path):
    sources = made_up(tmp_path, {"run/__init__.py": "", "verdict/__init__.py": '"""V."""\nfrom .compare import *\n'})
    assert init_problems(sources) == [
        "protocol.run/__init__.py: no docstring saying what the package owns",
        "protocol.verdict/__init__.py: holds more than its docstring; import from the modules themselves"]


def test_a_long_module_is_caught(tmp_path):
    sources = made_up(tmp_path, {"report/markdown.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_modules(sources) == [f"protocol.report.markdown: {MAX_LINES + 1} lines (at most {MAX_LINES}); "
                                     "split it along a seam"]
