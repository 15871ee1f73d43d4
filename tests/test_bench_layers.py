"""bench/'s layering (docs/ARCHITECTURE.md "bench/, in layers"): no command module imports another command
module, no helper or script imports a command, and what users run never imports the lab (bench/lab/), read from
the dispatch table and the sources' imports."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.__main__ import COMMANDS, LAB_COMMANDS, USER_COMMANDS, usage

ROOT = Path(__file__).resolve().parent.parent
COMMAND_MODULES = {module for module, _ in COMMANDS.values()}
# Helpers that may import a command, each with why (docs/ARCHITECTURE.md says the same): bench.sim.fit is also
# the library of the model curve (`predict`, `kv_ms`, `read_table`), and bench/sim modules stay where they are.
HELPER_EXCEPTIONS = {
    "bench.calibration": {"bench.sim.fit"},
    "bench.planmodel": {"bench.sim.fit"},
    "bench.fleet": {"bench.sim.fit"},
    # a lab script that starts one `goodput` row (its servers and router) and keeps the replay's per-request JSON
    "bench.lab.predictionrun": {"bench.lab.goodput"},
    "bench.sim.stepcost": {"bench.sim.fit"},
}


def module_path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every dotted name an import in `source` (at any depth: lazy imports inside functions count) can bind:
    `import a.b` -> a.b; `from a import b` -> a and a.b (b may be a module); relative imports resolved."""
    names: set[str] = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def commands_in(names: set[str], exclude: str = "") -> set[str]:
    """The command modules (other than `exclude`) that these imported names reach."""
    return {cmd for n in names for cmd in COMMAND_MODULES
            if cmd != exclude and (n == cmd or n.startswith(cmd + "."))}


def imports_of(path: Path) -> set[str]:
    return imported(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")


def test_the_resolver_sees_every_spelling_of_an_import():
    src = ("import bench.compare\nfrom bench import plan, equal\nfrom . import sweep\nfrom .sim import fit\n"
           "def f():\n    from bench.lab.stress import main\n")
    names = imported(src, "bench.demo")
    assert commands_in(names) == {"bench.compare", "bench.plan", "bench.sweep", "bench.sim.fit", "bench.lab.stress"}
    assert commands_in(imported("from . import fit\n", "bench.sim.stepcost")) == {"bench.sim.fit"}
    assert commands_in(imported("from .. import plan\n", "bench.sim", is_package=True)) == {"bench.plan"}
    assert not commands_in(imported("from bench.cli import profile\nfrom bench import equal\n", "bench.demo"))


def test_every_dispatched_module_exists():
    missing = [m for m in COMMAND_MODULES if not module_path(m).exists()]
    assert not missing, f"COMMANDS names modules that do not exist: {missing}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_command_module_imports_another_command_module(command):
    module = COMMANDS[command][0]
    bad = commands_in(imports_of(module_path(module)), exclude=module)
    assert not bad, (f"spec-bench {command} ({module}) imports the command module(s) {sorted(bad)}: move what they "
                     "share into a helper module (docs/ARCHITECTURE.md, bench/ layers)")


def helpers() -> list[Path]:
    files = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    return [f for f in files if module_name(f) not in COMMAND_MODULES and f.name != "__main__.py"]


def test_no_helper_or_script_imports_a_command():
    bad = {}
    for path in helpers():
        name = module_name(path)
        found = commands_in(imports_of(path)) - HELPER_EXCEPTIONS.get(name, set())
        if found:
            bad[str(path.relative_to(ROOT))] = sorted(found)
    assert not bad, f"helpers that import a command module: {bad}"


def test_the_exceptions_are_still_needed():
    stale = {m: sorted(allowed - commands_in(imports_of(module_path(m))))
             for m, allowed in HELPER_EXCEPTIONS.items() if allowed - commands_in(imports_of(module_path(m)))}
    assert not stale, f"HELPER_EXCEPTIONS lists imports that are gone (remove them): {stale}"


def test_the_lab_commands_live_in_bench_lab_and_the_users_do_not():
    assert all(module.startswith("bench.lab.") for module, _ in LAB_COMMANDS.values()), LAB_COMMANDS
    assert not any(module.startswith("bench.lab.") for module, _ in USER_COMMANDS.values()), USER_COMMANDS
    assert not set(USER_COMMANDS) & set(LAB_COMMANDS)


def test_nothing_outside_the_lab_imports_it():
    # the lab builds on bench's helpers, never the reverse: a user command runs without bench/lab/
    bad = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if "lab" in path.relative_to(ROOT / "bench").parts:
            continue
        found = {n for n in imports_of(path) if n == "bench.lab" or n.startswith("bench.lab.")}
        if found:
            bad[str(path.relative_to(ROOT))] = sorted(found)
    assert not bad, f"bench modules outside bench/lab/ that import it: {bad}"


def test_help_lists_the_user_commands_first_and_the_lab_apart():
    text = usage()
    lab_heading = next(i for i, line in enumerate(text.splitlines()) if line.startswith("lab commands"))
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  ")]
    assert listed == [*USER_COMMANDS, *LAB_COMMANDS]
    at = {line.split()[0]: i for i, line in enumerate(text.splitlines()) if line.startswith("  ")}
    assert all(at[name] < lab_heading for name in USER_COMMANDS) and all(at[n] > lab_heading for n in LAB_COMMANDS)
    assert all(f"  {name}  " in text for name in COMMANDS)  # every name apart from its text
