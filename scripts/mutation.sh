#!/usr/bin/env bash
# Mutation testing of router/ modules with mutmut, on demand (not in CI: minutes per module on 2 cores).
# Usage: bash scripts/mutation.sh [router/MODULE.py ...]   (default: the modules in pyproject's [tool.mutmut])
# Each module runs on its own, in a fresh copy of the tracked files (mutmut's mutants/ never touches the work
# tree), against its own fast test selection (MODULE_TESTS below; MUTATION_TESTS="tests/a.py ..." overrides).
# Prints one score line per module, every surviving mutant's diff, then the overall score; MUTATION_REPORT=path
# keeps a copy, MUTATION_KEEP=dir keeps each module's mutmut directory (for `mutmut show`, `mutmut run NAME`).
# MUTATION_JOBS workers (default 1: the machine is shared and the tests start servers of their own).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
MUTMUT="$ROOT/.venv/bin/mutmut"
[ -x "$PY" ] || bash scripts/install.sh
[ -x "$MUTMUT" ] || "$PY" -m pip install -q -e '.[mutation]' >/dev/null 2>&1 ||
  { echo "mutation: cannot install the mutation extra (pip install -e '.[mutation]')" >&2; exit 2; }

# The tests that reach each module and judge it from outside, fast (no e2e, bench, deploy or fuzz files).
# mutmut runs, for each mutant, only those of them that call the mutated function.
declare -A MODULE_TESTS=(
  [router/policy.py]="tests/test_policy.py tests/test_core.py tests/test_core_edges.py"
  [router/pools.py]="tests/test_pools.py tests/test_policy.py tests/test_outlier.py tests/test_router_health.py
    tests/test_router_discovery.py::test_removed_backend_with_leases_drains_then_disappears
    tests/test_router_discovery.py::test_idle_backend_is_dropped_at_once_and_readding_a_draining_one_revives_it
    tests/test_router_discovery.py::test_the_policy_sees_members_as_they_change
    tests/test_policy_adaptive.py::test_pools_feed_the_adaptive_policy"
  [router/health.py]="tests/test_router_health.py"
  [router/body.py]="tests/test_router_body.py tests/test_router_errors.py"
  [router/handlers.py]="tests/test_router_handlers.py tests/test_router_errors.py tests/test_security_router.py
    tests/test_proxy_branches.py::test_models_merges_answering_backends_and_skips_failing_ones
    tests/test_proxy_branches.py::test_models_is_503_when_no_backend_answers"
  [router/streaming.py]="tests/test_router_streaming.py
    tests/test_proxy_branches.py::test_split_stream_reaches_the_client_byte_for_byte
    tests/test_proxy_branches.py::test_usage_event_that_also_carries_choices_is_kept
    tests/test_router_proxy.py::test_stream_usage_is_stripped_unless_asked_and_still_counted"
  [router/watchdog.py]="tests/test_watchdog.py tests/test_router_hotpath.py::test_slow_reader_lease_ends_with_the_backend_and_its_connection_after_write_timeout
    tests/test_reliability_faults.py::test_stall_mid_stream_is_an_sse_error_then_done_and_aborts
    tests/test_reliability_outlier.py::test_streams_that_stall_after_good_headers_eject
    tests/test_upstream_errors.py::test_no_headers_in_time_is_504_no_first_byte
    tests/test_proxy_branches.py::test_hang_before_headers_is_504_and_not_retried
    tests/test_router_lifecycle.py::test_first_byte_timeout_is_504_and_aborts
    tests/test_exchange.py::test_a_request_still_waiting_for_headers_at_the_drain_deadline_gets_503
    tests/test_transport_seam.py::test_a_stream_that_keeps_talking_is_not_cut_by_idle_timeout"
  [router/upstream.py]="tests/test_router_h1.py tests/test_upstream_errors.py tests/test_transport_seam.py tests/test_proxy_branches.py
    tests/test_router_proxy.py tests/test_router_errors.py
    tests/test_router_health.py::test_a_local_failure_gives_no_verdict
    tests/test_router_health.py::test_probes_carry_the_pools_backend_key
    tests/test_router_discovery.py::test_members_join_and_leave_without_restart"
  [router/exchange.py]="tests/test_exchange.py tests/test_transport_seam.py tests/test_upstream_errors.py tests/test_proxy_branches.py
    tests/test_router_proxy.py tests/test_router_errors.py tests/test_router_routing.py tests/test_router_streaming.py
    tests/test_router_lifecycle.py tests/test_router_hotpath.py tests/test_reliability_shutdown.py
    tests/test_router_body.py::test_a_stalled_upload_is_408_with_the_deadline_named"
  # The decision core: pure, no sockets (tests/test_core_edges.py: the edges its mutants showed).
  [router/core/plugins.py]="tests/test_core.py tests/test_core_edges.py tests/test_core_eligible.py tests/test_prefix.py tests/test_policy.py"
  [router/core/scheduler.py]="tests/test_core.py tests/test_core_edges.py tests/test_core_eligible.py tests/test_prefix.py tests/test_policy.py"
  [router/core/snapshot.py]="tests/test_core.py tests/test_core_edges.py tests/test_prefix.py tests/test_policy.py"
  [router/core/figures.py]="tests/test_core.py tests/test_core_edges.py tests/test_prefix.py tests/test_pools.py"
  [router/affinity.py]="tests/test_core.py tests/test_core_edges.py tests/test_prefix.py"
  [router/policies/__init__.py]="tests/test_policy.py tests/test_core_edges.py"
  [router/policies/balanced.py]="tests/test_policy.py tests/test_core_edges.py"
  [router/policies/global_mode.py]="tests/test_policy.py tests/test_core_edges.py"
  [router/policies/least_inflight.py]="tests/test_policy.py tests/test_core_edges.py"
  [router/policies/round_robin.py]="tests/test_policy.py tests/test_core_edges.py"
  [router/policies/spillover.py]="tests/test_policy.py tests/test_core_edges.py"
)

if [ "$#" -gt 0 ]; then
  MODULES=("$@")
else
  mapfile -t MODULES < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["mutmut"]["only_mutate"]))')
fi
for m in "${MODULES[@]}"; do
  [ -f "$m" ] || { echo "mutation: no such module: $m" >&2; exit 2; }
done

COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- router tests || echo "+changes")
REPORT=$(mktemp "${TMPDIR:-/tmp}/mutation-report.XXXXXX")
trap 'rm -f "$REPORT"' EXIT
for m in "${MODULES[@]}"; do
  tests=""
  for t in ${MUTATION_TESTS:-${MODULE_TESTS[$m]:-tests/test_proxy_branches.py tests/test_router_proxy.py}}; do
    [ -f "${t%%::*}" ] && tests="$tests $t"
  done
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/mutation.XXXXXX")
  git ls-files -z | xargs -0 cp --parents -t "$WORK"
  # Untracked new test files are part of the selection while they are being written.
  for t in $tests; do cp --parents "${t%%::*}" "$WORK"; done
  (
    cd "$WORK"
    "$PY" - "$m" $tests <<'PY'
import json, re, sys
from pathlib import Path
p = Path("pyproject.toml")
text = re.sub(r"only_mutate = \[[^\]]*\]", "only_mutate = " + json.dumps(sys.argv[1:2]), p.read_text(), count=1)
text = re.sub(r"pytest_add_cli_args_test_selection = \[[^\]]*\]",
              "pytest_add_cli_args_test_selection = " + json.dumps(sys.argv[2:]), text, count=1)
p.write_text(text)
PY
    start=$(date +%s)
    "$MUTMUT" run --max-children "${MUTATION_JOBS:-1}" > run.log 2>&1 || {
      tr '\r' '\n' < run.log | tail -20 >&2; echo "mutation: mutmut run failed for $m" >&2; exit 1; }
    elapsed=$(( $(date +%s) - start ))
    "$MUTMUT" results --all true > results.txt
    "$PY" - "$m" "$elapsed" "$MUTMUT" "$COMMIT" "$tests" <<'PY'
import subprocess, sys
from collections import Counter
module, elapsed, mutmut, commit, tests = sys.argv[1:]
rows = [line.strip().rsplit(": ", 1) for line in open("results.txt") if ": " in line]
counts = Counter(status for _, status in rows)
killed = counts["killed"] + counts["timeout"]
judged = killed + counts["survived"]
other = {k: v for k, v in counts.items() if k not in ("killed", "survived", "timeout")}
print(f"SCORE {module} mutants={len(rows)} killed={killed} survived={counts['survived']} "
      f"score={killed / judged if judged else 0:.1%} seconds={elapsed} commit={commit} other={other} tests={tests}")
for name, status in rows:
    if status == "survived":
        print(subprocess.run([mutmut, "show", name], capture_output=True, text=True).stdout.rstrip())
PY
  ) | tee -a "$REPORT"
  if [ -n "${MUTATION_KEEP:-}" ]; then
    mkdir -p "$MUTATION_KEEP"; rm -rf "${MUTATION_KEEP:?}/$(basename "$m" .py)"; mv "$WORK" "$MUTATION_KEEP/$(basename "$m" .py)"
  else
    rm -rf "$WORK"
  fi
done
"$PY" - "$REPORT" <<'PY' | tee -a "$REPORT"
import re, sys
rows = [re.findall(r"(\w+)=(\S+)", line) for line in open(sys.argv[1]) if line.startswith("SCORE ")]
killed = sum(int(dict(r)["killed"]) for r in rows)
survived = sum(int(dict(r)["survived"]) for r in rows)
print(f"OVERALL killed={killed} survived={survived} score={killed / max(1, killed + survived):.1%} over {len(rows)} module(s)")
PY

[ -z "${MUTATION_REPORT:-}" ] || cp "$REPORT" "$MUTATION_REPORT"
