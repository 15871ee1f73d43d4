"""`spec-router` as people type it: short top-level help, full `serve --help`, a bare command, no abbreviations,
one program name, and configuration errors that name the variable or flag to fix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.__main__ import build_parser, main, parse
from router.settings import ConfigError, Settings, load_settings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_is_short_and_points_to_serve(capsys, flag):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: spec-router serve ") and len(out.splitlines()) <= 20
    assert "spec-router serve --help" in out and "--threshold" not in out


def test_serve_help_lists_every_setting_under_one_program_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: spec-router serve [-h]")
    assert "python -m" not in out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in out


def test_every_serve_flag_has_help_text():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    missing = [a.option_strings for a in serve._actions if a.option_strings and not (a.help or "").strip()]
    assert missing == []


def test_a_switch_shows_its_values_and_takes_them():
    # A boolean setting is a flag with a value (true/false), never shown as `KEY`; the parsed value is a bool.
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    metavars = {a.dest: a.metavar for a in serve._actions if a.option_strings}
    switches = [n for n, f in Settings.model_fields.items() if f.annotation is bool]
    assert "prefix_routing" in switches
    assert {metavars[n] for n in switches} == {"{true,false}"}
    assert parse(["serve", "--speculative", "http://127.0.0.1:1", "--prefix-routing", "false"]).prefix_routing is False


@pytest.mark.parametrize("command", ["serve", "epp"])
def test_list_flags_show_the_form_of_their_entries(capsys, command):
    # Backend lists take URLs; the InferencePool list takes references, not URLs (the help said URL for both).
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the usage block where it likes
    for shown in ("--speculative URL", "--baseline URL", "--k8s-inference-pools [NS/]NAME[=POOL]",
                  "--k8s-api URL", "--k8s-token-file FILE", "--k8s-ca-file FILE"):
        assert f"[{shown}]" in out and f"{shown} " in out.split("options:")[1], shown
    assert "--k8s-inference-pools URL" not in out
    # the flag still takes entries in that form, repeated or comma-separated
    s = parse([command, "--k8s-api", "http://127.0.0.1:8001", "--k8s-inference-pools", "ns/a=speculative,b",
               "--k8s-inference-pools", "ns/c", "--k8s-namespace", "llm"])
    assert s.k8s_inference_pools == ["ns/a=speculative", "b", "ns/c"]


def test_a_bare_command_prints_short_usage_to_stderr_and_exits_2():
    r = subprocess.run([sys.executable, "-m", "router"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0].startswith("usage: spec-router serve ") and len(lines) == 2
    assert lines[1].startswith("spec-router: error: a command is required")


@pytest.mark.parametrize("flag", ["--baseli", "--spec", "--thresh"])
def test_abbreviations_are_errors(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", flag, "http://127.0.0.1:1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"spec-router: error: unrecognized arguments: {flag} http://127.0.0.1:1 "
                                "(see spec-router serve --help)"]


@pytest.mark.parametrize("env, flags, needle", [
    ({"ROUTER_THRESHOLD": "lots"}, {}, "threshold (env ROUTER_THRESHOLD): Input should be a valid integer"),
    ({"ROUTER_HEALTH_INTERVAL": "-1"}, {}, "health_interval (env ROUTER_HEALTH_INTERVAL): Input should be greater"),
    ({"ROUTER_BASELINE": "nope"}, {}, "baseline (env ROUTER_BASELINE): bad backend URL 'nope'"),
    ({"ROUTER_THRESHOLD": "lots"}, {"threshold": "-2"}, "threshold (--threshold): Input should be greater"),
])
def test_config_errors_name_where_the_value_came_from(env, flags, needle):
    with pytest.raises(ConfigError) as info:
        load_settings(None, {"speculative": "http://127.0.0.1:1", **flags}, environ=env)
    assert str(info.value).startswith(needle), str(info.value)


def test_a_yaml_error_names_the_file(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("speculative: [http://127.0.0.1:1]\nthreshold: many\n")
    with pytest.raises(ConfigError, match=r"^threshold \(config file .*r\.yaml\): Input should be a valid integer"):
        load_settings(str(cfg), {}, environ={})


def test_env_error_through_the_cli_is_one_line_naming_the_variable():
    r = subprocess.run([sys.executable, "-m", "router", "serve", "--baseline", "http://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", "ROUTER_THRESHOLD": "lots"})
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "spec-router: error: threshold (env ROUTER_THRESHOLD): Input should be a valid integer, unable to parse "
        "string as an integer"]
