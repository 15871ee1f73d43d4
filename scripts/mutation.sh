#!/usr/bin/env bash
# Mutation testing of router/ modules with mutmut, on demand (not in CI: minutes per module on 2 cores).
# Usage: bash scripts/mutation.sh [router/MODULE.py ...]   (default: the modules in pyproject's [tool.mutmut])
# Runs in a copy of the tracked files, so mutmut's mutants/ never touches the work tree. Prints the score,
# then every surviving mutant with its diff (also written to $MUTATION_REPORT when set).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
[ -x .venv/bin/python ] || bash scripts/install.sh
.venv/bin/python -m pip install -q -e '.[mutation]' >/dev/null
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mutation.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$WORK"
cd "$WORK"
if [ "$#" -gt 0 ]; then
  # Only the modules asked for: the copy's only_mutate list is replaced.
  "$ROOT/.venv/bin/python" - "$@" <<'PY'
import json, re, sys
from pathlib import Path
p = Path("pyproject.toml")
p.write_text(re.sub(r"only_mutate = \[[^\]]*\]", "only_mutate = " + json.dumps(sys.argv[1:]), p.read_text(), count=1))
PY
fi
# One worker by default: the machine is shared, and the tests start servers of their own.
start=$(date +%s)
"$ROOT/.venv/bin/mutmut" run --max-children "${MUTATION_JOBS:-1}" > "$WORK/run.log" 2>&1 || {
  tail -20 "$WORK/run.log" >&2; echo "mutation: mutmut run failed" >&2; exit 1; }
elapsed=$(( $(date +%s) - start ))
"$ROOT/.venv/bin/mutmut" results --all true > "$WORK/results.txt"
"$ROOT/.venv/bin/python" - "$elapsed" "$ROOT/.venv/bin/mutmut" "$@" <<'PY' | tee "${MUTATION_REPORT:-/dev/null}"
import subprocess, sys
from collections import Counter
elapsed, mutmut, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = [line.strip().rsplit(": ", 1) for line in open("results.txt") if ": " in line]
counts = Counter(status for _, status in rows)
judged = counts["killed"] + counts["survived"] + counts["timeout"]
score = (counts["killed"] + counts["timeout"]) / judged if judged else 0.0
print(f"mutation score {score:.1%}: {counts['killed']} killed, {counts['timeout']} timed out, "
      f"{counts['survived']} survived of {judged} judged; also {dict((k, v) for k, v in counts.items() "
      f"if k not in ('killed', 'survived', 'timeout'))}; modules {modules or 'pyproject default'}; {elapsed} s")
for name, status in rows:
    if status == "survived":
        print()
        print(subprocess.run([mutmut, "show", name], capture_output=True, text=True).stdout.rstrip())
PY
