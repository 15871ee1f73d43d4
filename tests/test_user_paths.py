"""User paths: installed commands, every bench command's help, one-line missing-extra errors, a fresh install."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import __main__ as bench_main

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-2000:]


def test_every_bench_command_answers_help():
    # All at once: each is a fresh interpreter importing its module, the slow part.
    running = {name: subprocess.Popen([sys.executable, "-m", "bench", name, "--help"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name in bench_main.COMMANDS}
    for name, p in running.items():
        out, err = p.communicate(timeout=60)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        assert r.returncode == 0, f"{name}: {err[-500:]}"
        assert "usage:" in out, name
        _no_traceback(r)


def test_every_bench_command_names_itself_spec_bench_in_a_bad_flag_error():
    # The program the user typed is spec-bench: its errors say so (not `bench CMD:`), one line, exit 2.
    running = {name: subprocess.Popen([sys.executable, "-m", "bench", name, "--no-such-flag"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name in bench_main.COMMANDS}
    for name, p in running.items():
        out, err = p.communicate(timeout=60)
        assert p.returncode == 2, f"{name}: {err[-500:]}"
        assert err.startswith(f"spec-bench {name}") and err.count("\n") == 1, (name, err)


@pytest.mark.parametrize("script, words", [("spec-router", "serve"), ("spec-bench", "overhead")])
def test_console_scripts_are_installed(script, words):
    exe = BIN / script
    assert exe.exists(), f"{exe} missing: pip install -e '.[dev]' (scripts/install.sh) installs it"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and words in r.stdout
    _no_traceback(r)


def _blocked(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    # None in sys.modules makes `import module` fail as if it were not installed.
    code = (f"import sys; sys.modules[{module!r}] = None; from bench.__main__ import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)


# The engine extra is built from source, so its line names the script that caches the build.
HOW = {"bench": "pip install 'spec-router[bench]'", "engine": "bash scripts/install_engine.sh"}


@pytest.mark.parametrize("command, module", [(c, m) for c, mods in bench_main.NEEDS.items() for m in mods])
def test_a_missing_extra_is_one_line_and_exit_2(command, module):
    r = _blocked(module, [command])
    assert r.returncode == 2
    extra = "engine" if command == "engines" else "bench"
    # The line names the first missing module of the extra: an earlier one when this venv lacks it too (the
    # engine extra is only in venvs made with `scripts/test.sh --real-engine`).
    mods = bench_main.NEEDS[command]
    named = next(m for m in mods[:mods.index(module)] + (module,)
                 if m == module or importlib.util.find_spec(m) is None)
    assert r.stderr.splitlines() == [
        f"spec-bench {command} needs the {extra} extra ({named} is not installed): {HOW[extra]}"]
    _no_traceback(r)
    # --help needs nothing optional
    r = _blocked(module, [command, "--help"])
    assert r.returncode == 0 and "usage:" in r.stdout


def test_no_plot_needs_no_matplotlib():
    r = _blocked("matplotlib", ["sweep", "--no-plot", "--target", "x=http://127.0.0.1:1", "--concurrency", "0"])
    assert r.returncode == 2 and "extra" not in r.stderr  # the bad flag is what is reported, not the extra
    _no_traceback(r)


def test_a_lazy_import_of_an_extra_is_one_line_too(tmp_path, monkeypatch, capsys):
    (tmp_path / "lazy_cmd.py").write_text("def main(argv):\n    import psutil  # noqa: F401\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setitem(bench_main.COMMANDS, "lazy", ("lazy_cmd", "test"))
    assert bench_main.main(["lazy"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "spec-bench lazy needs the bench extra (psutil is not installed): pip install 'spec-router[bench]'"]
    # a module that is no extra's is a bug: it is raised, not hidden
    (tmp_path / "buggy_cmd.py").write_text("def main(argv):\n    import no_such_module_x  # noqa: F401\n")
    monkeypatch.setitem(bench_main.COMMANDS, "buggy", ("buggy_cmd", "test"))
    with pytest.raises(ModuleNotFoundError):
        bench_main.main(["buggy"])


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    (tmp_path / "slow_cmd.py").write_text("def main(argv):\n    raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(bench_main.COMMANDS, "slow", ("slow_cmd", "test"))
    assert bench_main.main(["slow"]) == 130
    assert capsys.readouterr().err.splitlines() == ["spec-bench slow: interrupted"]


def _install_block() -> list[str]:
    """The commands of the README's install block (the one that starts with `pip install .`)."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
        lines = [ln for ln in lines if ln]
        if lines and lines[0] == "pip install .":
            return lines
    raise AssertionError("README has no ```bash block starting with `pip install .`")


def _copy_sources(dest: Path) -> None:
    skip = {".venv", ".git", "bench-out", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
    shutil.copytree(ROOT, dest, ignore=lambda d, names: [n for n in names if n in skip or n.endswith(".egg-info")])


@pytest.mark.timeout(900)
def test_fresh_install_as_the_readme_says(tmp_path):
    """A new venv (no system site packages) on PATH, the README's Quick-use lines run as written, in order; after
    the first, every command explains itself without any extra; the demo's printed next step runs as printed."""
    steps = _install_block()
    assert steps[:2] == ["pip install .", "pip install '.[bench]'"], steps
    src, venv = tmp_path / "src", tmp_path / "venv"
    _copy_sources(src)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    vbin = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{vbin}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def sh(line: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(line, shell=True, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)

    r = sh(steps[0])
    assert r.returncode == 0, r.stderr[-2000:]
    # Without any extra every command still explains itself (optional imports are lazy).
    for name in bench_main.COMMANDS:
        r = sh(f"spec-bench {name} --help", 60)
        assert r.returncode == 0 and "usage:" in r.stdout, (name, r.stderr[-1000:])
    demo = next(s for s in steps if s.startswith("spec-bench demo"))
    # Before the bench extra: one line that says which extra, no traceback, nothing started.
    r = sh(demo, 60)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "spec-bench demo needs the bench extra (matplotlib is not installed): pip install 'spec-router[bench]'"]
    for line in steps[1:]:
        r = sh(line, 300)
        assert r.returncode == 0, (line, r.stderr[-2000:])
        _no_traceback(r)
        if line.endswith("--help"):
            assert "usage:" in r.stdout, line
        if line == demo:
            assert "verdict: " in r.stdout and "split+balanced" in r.stdout and "plot: " in r.stdout
            lines = r.stdout.splitlines()
            pasted = lines[lines.index("next, what to run on these GPUs by load:") + 1].strip()
            assert pasted == "spec-bench plan bench-out/demo/demo.json", pasted  # this venv is on PATH
            r = sh(pasted, 60)
            assert r.returncode == 0 and r.stdout.split()[0] in ("RUN", "Beats"), r.stderr[-1000:]
    print(f"fresh install + demo: {time.monotonic() - t0:.0f} s")
