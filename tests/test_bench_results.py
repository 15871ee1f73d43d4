"""bench/results/ keeps the runs the docs cite, nothing else: every file there is named by a doc, test, script or
code comment (its path, a glob or a folder that matches it), every path they cite exists, no file there is named
after a work session or a commit (git keeps the history), the folder stays small, and README.md and docs/ carry no
session tags."""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "bench/results"
# `bench/results/...`: a path, a folder or a glob (* ? {a,b}; a shell `$p` stands for any name) as the docs write
# them. The folder bench/results/ itself names nothing in particular.
CITED = re.compile(r"bench/results/[\w.*?{},/$-]*[\w*}/]")
SHELL_VAR = re.compile(r"\$\{?\w+\}?")
# inside a README under bench/results/DIR/: a backticked name relative to DIR (`h200.json`, `plots/`)
LOCAL = re.compile(r"`([\w.*?{},/-]+(?:\.(?:json|log|png|csv|md|txt|sh)|/))`")
SELF = "tests/test_bench_results.py"  # its examples are not citations
# The kept runs are a few MB (judge JSONs and the H200 run are the largest); history lives in git, not here.
MAX_RESULTS_BYTES = 5 * 1024 * 1024
# A path segment named after a session (s31, ab-s44, i28, s32b), a numbered run (run1) or a commit (44caa1f).
ITERATION_NAME = re.compile(r"(?:^|[/_.-])(?:(?:ab-)?s\d{2}[a-z]?|i\d{2}|run\d+|(?=[0-9a-f]*\d)[0-9a-f]{7,40})(?=[/_.-]|$)")
# What a session tag looks like in prose (`s42`, `ab-s44`); README.md and docs/ must carry none.
SESSION_TAG = re.compile(r"\bs[0-9]{2}\b|ab-s[0-9]+")
CITING_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".yml", ".yaml"}


def tree_files() -> list[str]:
    """The files git tracks plus the untracked ones it does not ignore (a helper's new results count)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.splitlines() if (ROOT / p).is_file()})


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",")
            for x in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def matches(cited: str, files: list[str]) -> list[str]:
    """The result files a citation names: the file itself, every file below a folder, or a glob's matches
    (`*` stays within one path segment)."""
    found = []
    for pat in expand_braces(SHELL_VAR.sub("*", cited)):
        if not pat.endswith("/") and (ROOT / pat).is_dir():
            pat += "/"
        if pat == RESULTS + "/":
            continue
        if pat.endswith("/"):
            found += [f for f in files if f.startswith(pat)]
        elif any(c in pat for c in "*?["):
            rx = re.compile(fnmatch.translate(pat).replace(".*", "[^/]*"))
            found += [f for f in files if rx.fullmatch(f)]
        else:
            found += [f for f in files if f == pat]
    return found


def citations(files: list[str]) -> dict[str, list[str]]:
    """citation -> the citing files, from every doc, test, script and source file outside bench/results, and
    from the READMEs and scripts inside it (a README's backticked names are relative to its folder)."""
    cites: dict[str, list[str]] = {}
    for f in files:
        path = ROOT / f
        if path.suffix not in CITING_SUFFIXES or f.startswith(".venv/") or f == SELF:
            continue
        inside = f.startswith(RESULTS + "/")
        if inside and not (path.name.upper().startswith("README") or path.suffix == ".sh"):
            continue  # a result file does not cite the others
        text = path.read_text(encoding="utf-8", errors="replace")
        found = [m.group(0).rstrip(".,;:") for m in CITED.finditer(text)]
        if inside and path.suffix == ".md":
            here = str(Path(f).parent)
            found += [f"{here}/{name}" for name in LOCAL.findall(text)]
        for c in found:
            cites.setdefault(c, []).append(f)
    return cites


FILES = tree_files()
RESULT_FILES = [f for f in FILES if f.startswith(RESULTS + "/")]
CITES = citations(FILES)


def test_the_citation_reader_sees_paths_globs_folders_and_braces():
    files = ["bench/results/a-1.json", "bench/results/a-1.png", "bench/results/b/x.log", "bench/results/b/c/y.txt"]
    assert matches("bench/results/a-*", files) == files[:2]
    assert matches("bench/results/*.log", files) == []  # `*` does not cross a folder
    assert matches("bench/results/b/", files) == files[2:]
    assert matches("bench/results/a-1.{json,png}", files) == files[:2]
    assert matches("bench/results/a-2.json", files) == []
    assert matches("bench/results/a-$p.png", files) == files[1:2]
    assert matches("bench/results/", files) == []  # the whole folder is no citation
    found = [m.group(0) for m in CITED.finditer("see `bench/results/a-*.json`, and bench/results/b/.")]
    assert found == ["bench/results/a-*.json", "bench/results/b/"]


@pytest.mark.parametrize("cited", sorted(CITES))
def test_every_cited_result_exists(cited):
    assert matches(cited, RESULT_FILES), f"{cited} (cited by {', '.join(CITES[cited])}) matches no file"


def test_every_result_file_is_cited():
    cited = {f for c in CITES for f in matches(c, RESULT_FILES)}
    # a folder's README is a doc itself (it says what the files beside it are)
    orphans = [f for f in RESULT_FILES if f not in cited and not Path(f).name.upper().startswith("README")]
    assert not orphans, (f"{len(orphans)} file(s) under {RESULTS} that no doc, test or script names (cite each "
                         f"where its figures are discussed as `{RESULTS}/NAME`, a glob or its folder, or delete "
                         f"it): {orphans}")


def test_the_iteration_name_pattern_sees_sessions_runs_and_commits():
    for bad in ["bench/results/ab-s44/x.md", "bench/results/judge-s29-llamacpp.sh", "bench/results/a-44caa1f.json",
                "bench/results/gpu/run1/h200.json", "bench/results/x-s32b.md", "bench/results/c-i28-light.csv"]:
        assert ITERATION_NAME.search(bad), bad
    for good in ["bench/results/judge/llamacpp-96.md", "bench/results/gpu/h200.json", "bench/results/eagle3-good-tp4.json",
                 "bench/results/verdict/demo-kimi-k25-h200-nvlink-adaptive-a55.json", "bench/results/judge/family-issue28.md",
                 "bench/results/stepcost/plan-deepseek-v3-h200-nvlink.txt"]:
        assert not ITERATION_NAME.search(good), good


def test_no_result_is_named_after_a_session_a_run_or_a_commit():
    named = [f for f in RESULT_FILES if ITERATION_NAME.search(f[len(RESULTS):])]
    assert not named, f"name these by what they measure (git mv), or delete them: {named}"


def test_the_results_folder_stays_small():
    total = sum((ROOT / f).stat().st_size for f in RESULT_FILES)
    assert total <= MAX_RESULTS_BYTES, (f"{RESULTS} holds {total:,} bytes, over {MAX_RESULTS_BYTES:,}: keep the runs "
                                        "a doc cites today, JSON and reports rather than plots, and let git keep the rest")


@pytest.mark.parametrize("doc", ["README.md", *sorted(f for f in FILES if f.startswith("docs/") and f.endswith(".md"))])
def test_docs_carry_no_session_tags(doc):
    lines = [f"{n}: {line.strip()[:100]}" for n, line in
             enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1) if SESSION_TAG.search(line)]
    assert not lines, f"{doc} names work sessions (say what changed, not when): {lines}"
