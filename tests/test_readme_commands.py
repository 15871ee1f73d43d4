"""Every `spec-bench` / `spec-router` command line quoted in README.md and docs/*.md names a subcommand and flags
that exist (`--help` level: names, not values). The files are read at test time, the parsers called in-process."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml

from bench import __main__ as bench_main
from router import __main__ as router_main

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `spec-bench X`, `.venv/bin/spec-bench X`, `python -m bench X`, `.venv/bin/python -m bench X` (and router's).
PROGRAM = re.compile(r"^(?:\S*/)?(?:(?P<script>spec-bench|spec-router)|python3?(?:\.\d+)?\s+-m\s+(?P<module>bench|router))"
                     r"(?=\s|$)")
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline span, possibly wrapped once
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|^\.\.\.$")  # COMMAND, X, ...


def _pieces(line: str) -> list[str]:
    """A shell line's commands: comments dropped, split at && || ; | and a trailing &."""
    line = re.sub(r"(^|\s)#.*$", "", line)
    return [p.strip().removesuffix("&").strip() for p in re.split(r"&&|\|\||;|\s\|\s", line) if p.strip()]


def quoted_commands() -> list[tuple[str, str]]:
    """(where, command) for each command line that starts with one of our programs."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        for block in FENCE.findall(text):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                for piece in _pieces(line.strip().removeprefix("$ ")):
                    found.append((name, piece))
        for span in SPAN.findall(FENCE.sub("", text)):
            found.append((name, " ".join(span.split())))
    out = []
    for where, cmd in found:
        cmd = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", cmd)  # leading VAR=value assignments
        if PROGRAM.match(cmd):
            out.append((where, cmd))
    return out


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@cache
def bench_parser(command: str) -> argparse.ArgumentParser:
    """The parser `spec-bench COMMAND` builds, caught at its first parse (its main is called, nothing runs)."""
    module = importlib.import_module(bench_main.COMMANDS[command][0])
    real = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        module.main(["--help"])
    except _Captured as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_known_args = real
    raise AssertionError(f"spec-bench {command} parsed no arguments with argparse")


def _flags(tokens: list[str]) -> list[str]:
    flags = []
    for tok in tokens:
        tok = tok.strip("[](),.;:'\"")
        if tok.startswith("--") and len(tok) > 2:
            flags += [f.split("=")[0] for f in tok.split("/") if f.startswith("--")]
        elif tok in ("-h",):
            flags.append(tok)
    return flags


def problems(cmd: str) -> list[str]:
    m = PROGRAM.match(cmd)
    assert m is not None
    program = "bench" if (m.group("script") == "spec-bench" or m.group("module") == "bench") else "router"
    try:
        tokens = shlex.split(cmd[m.end():])
    except ValueError:
        tokens = cmd[m.end():].split()
    sub = tokens[0].strip("[]") if tokens else ""
    if program == "router":
        top, _ = router_main._parsers()
        (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub or sub.startswith("-") or PLACEHOLDER.match(sub):
            parser, rest = top, tokens
        elif sub in commands.choices:  # serve, epp
            parser, rest = commands.choices[sub], tokens[1:]
        else:
            return [f"spec-router has no command {sub!r}"]
    else:
        if not sub or sub.startswith("-") or PLACEHOLDER.match(sub):
            return [] if all(t in ("-h", "--help") or PLACEHOLDER.match(t) or t.startswith("[")
                             for t in tokens) else [f"spec-bench takes a command first: {tokens}"]
        if sub not in bench_main.COMMANDS:
            return [f"spec-bench has no command {sub!r}"]
        parser, rest = bench_parser(sub), tokens[1:]
        # A command with commands of its own (`spec-bench gpu run ...`): its flags are the inner command's.
        inner = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if inner and rest and rest[0] in inner[0].choices:
            parser, rest = inner[0].choices[rest[0]], rest[1:]
    known = set(parser._option_string_actions)
    return [f"no flag {f}" for f in _flags(rest) if f not in known]


COMMANDS = quoted_commands()


def test_the_docs_quote_commands_at_all():
    where = {w for w, _ in COMMANDS}
    assert "README.md" in where and len(COMMANDS) > 30, COMMANDS


def test_every_quoted_command_parses():
    bad = [f"{where}: {cmd}\n    -> {'; '.join(p)}" for where, cmd in COMMANDS if (p := problems(cmd))]
    assert not bad, "quoted commands that would not parse:\n" + "\n".join(bad)


@pytest.mark.parametrize("cmd, why", [
    ("spec-bench nosuch --x", "spec-bench has no command 'nosuch'"),
    ("spec-bench demo --concurency 4", "no flag --concurency"),
    ("python -m router serve --baseli http://x:1", "no flag --baseli"),
    ("spec-router start", "spec-router has no command 'start'"),
    ("spec-router epp --epp-prot 9002", "no flag --epp-prot"),
])
def test_the_check_catches_a_wrong_command(cmd, why):
    assert problems(cmd) == [why]


def test_the_check_accepts_right_ones():
    for cmd in ("spec-bench demo --concurrency 1,4 --max-tokens 16", ".venv/bin/python -m bench plan x.json",
                "spec-router serve --speculative URL1 --baseline URL2 --health-path /openapi.json",
                "spec-router --help", "spec-bench COMMAND --help",
                "spec-router epp --config router.yaml --epp-port 9002 --metrics-host 0.0.0.0 --metrics-port 9090"):
        assert problems(cmd) == [], cmd


def test_the_example_yaml_matches_the_readme():
    """deploy/router.example.yaml: the README's backend ports, and its policy comment lists every policy."""
    import typing

    from router.settings import PolicyName

    POLICIES = typing.get_args(PolicyName)

    text = (ROOT / "deploy" / "router.example.yaml").read_text()
    cfg = yaml.safe_load(text)
    readme = (ROOT / "README.md").read_text()
    first = next(cmd for _, cmd in COMMANDS if cmd.startswith("pip install . && spec-router serve")
                 or cmd.startswith("spec-router serve --speculative"))
    tokens = first.split()
    assert cfg["speculative"] == [tokens[tokens.index("--speculative") + 1]], first
    assert cfg["baseline"] == [tokens[tokens.index("--baseline") + 1]], first
    policy_line = next(ln for ln in text.splitlines() if ln.startswith("policy:"))
    assert all(p in policy_line for p in POLICIES), policy_line
    assert "http://127.0.0.1:30001" in readme and "http://127.0.0.1:30000" not in readme


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_land_on_a_file_and_heading():
    bad = []
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(((?:\.\./|docs/)?[\w./-]*\.md)?#([\w-]+)\)", path.read_text()):
            dest = (path.parent / target).resolve() if target else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} missing")
                continue
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
            if anchor not in slugs:
                bad.append(f"{path.name}: {target or path.name}#{anchor}")
    assert not bad, bad
