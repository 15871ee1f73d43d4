"""Settings layering (YAML < ROUTER_ env < flags) and the CLI's one-line errors with exit code 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.settings import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_layers_yaml_then_env_then_flags(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("speculative: [http://127.0.0.1:1]\nbaseline: [http://127.0.0.1:2]\nthreshold: 8\n"
                   "hysteresis: 1\npolicy: global\n")
    s = load_settings(str(cfg), {}, environ={})
    assert (s.threshold, s.hysteresis, s.policy) == (8, 1, "global")
    s = load_settings(str(cfg), {}, environ={"ROUTER_THRESHOLD": "5", "ROUTER_HYSTERESIS": "3"})
    assert (s.threshold, s.hysteresis) == (5, 3)
    s = load_settings(str(cfg), {"threshold": "2"}, environ={"ROUTER_THRESHOLD": "5"})
    assert (s.threshold, s.hysteresis, s.speculative) == (2, 1, ["http://127.0.0.1:1"])


def test_the_old_name_of_max_running_requests_is_still_taken(tmp_path):
    from router.__main__ import parse

    cfg = tmp_path / "r.yaml"
    cfg.write_text("baseline: [http://b:1]\nadaptive_max_running: 9\n")
    assert load_settings(str(cfg), {}, environ={}).max_running_requests == 9
    assert load_settings(str(cfg), {}, environ={"ROUTER_ADAPTIVE_MAX_RUNNING": "12"}).max_running_requests == 12
    assert load_settings(str(cfg), {"adaptive_max_running": "5"}, environ={}).max_running_requests == 5
    assert parse(["serve", "--baseline", "http://b:1", "--adaptive-max-running", "7"]).max_running_requests == 7
    # A later layer's new name overrides an earlier one's old name; both names in one layer, differing: which one
    # was meant is not known.
    assert load_settings(str(cfg), {"max_running_requests": "5"}, environ={}).max_running_requests == 5
    with pytest.raises(ConfigError, match="old name of max_running_requests"):
        load_settings(str(cfg), {"max_running_requests": "5", "adaptive_max_running": "6"}, environ={})
    with pytest.raises(ConfigError, match="old name of ROUTER_MAX_RUNNING_REQUESTS"):
        load_settings(None, {"baseline": "http://b:1"},
                      environ={"ROUTER_ADAPTIVE_MAX_RUNNING": "4", "ROUTER_MAX_RUNNING_REQUESTS": "8"})
    with pytest.raises(ConfigError, match=r"max_running_requests \(config file"):
        cfg.write_text("baseline: [http://b:1]\nadaptive_max_running: 0\n")
        load_settings(str(cfg), {}, environ={})


def test_config_path_from_env_and_url_lists(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("baseline: http://b:1, http://b:2/\n")
    s = load_settings(None, {}, environ={"ROUTER_CONFIG": str(cfg), "ROUTER_SPECULATIVE": '["http://s:1"]'})
    assert s.baseline == ["http://b:1", "http://b:2"]
    assert s.speculative == ["http://s:1"]


def test_example_config_is_valid():
    s = load_settings(str(ROOT / "deploy" / "router.example.yaml"), {}, environ={})
    assert s.speculative and s.baseline


@pytest.mark.parametrize(("yaml_text", "env", "flags", "needle"), [
    ("", {}, {}, "no backend configured"),
    ("speculative: [ftp://x]", {}, {}, "bad backend URL"),
    ("speculative: [http://x:1]", {"ROUTER_THRESHOLD": "-1"}, {}, "threshold"),
    ("speculative: [http://x:1]", {}, {"policy": "fastest"}, "policy"),
    ("speculative: [http://x:1]\nbogus: 1", {}, {}, "unknown setting"),
    ("speculative: [http://x:1", {}, {}, "not valid YAML"),
    ("- a\n- b", {}, {}, "mapping"),
    ("speculative: [http://x:1]\nbaseline: [http://x:1]", {}, {}, "both pools"),
    ("speculative: [http://x:1, http://x:1]", {}, {}, "twice"),
    ("speculative: ['http://u:secret@x:1']", {}, {}, "must not carry credentials"),
    ("speculative: [http://x:1]", {}, {"metrics_port": "9"}, "go together"),
    ("speculative: [http://x:1]", {}, {"connect_timeout": "0"}, "connect_timeout"),
    ("speculative: [http://x:1]\npolicy: balanced", {}, {}, "needs speculative_curve and baseline_curve"),
    ("speculative: [http://x:1]\npolicy: balanced\nspeculative_curve: [[1, 5], [2, 8]]", {}, {},
     "needs speculative_curve and baseline_curve"),
    ("speculative: [http://x:1]\nspeculative_curve: [[1, 5]]", {}, {}, "at least 2 points"),
    ("speculative: [http://x:1]\nspeculative_curve: [[2, 5], [1, 8]]", {}, {}, "must increase"),
    ("speculative: [http://x:1]\nspeculative_curve: [[1, 5], [1, 8]]", {}, {}, "must increase"),
    ("speculative: [http://x:1]", {"ROUTER_BASELINE_CURVE": "1:5,2:0"}, {}, "must be positive"),
    ("speculative: [http://x:1]", {"ROUTER_BASELINE_CURVE": "0:5,2:7"}, {}, "must be positive"),
    ("speculative: [http://x:1]", {}, {"baseline_curve": "1:5,2"}, "bad curve point '2'"),
    ("speculative: [http://x:1]", {}, {"baseline_curve": "1:5,two:7"}, "bad curve point"),
    ("speculative: [http://x:1]", {}, {"baseline_curve": "[[1, 5], [2"}, "not valid JSON"),
    ("speculative: [http://x:1]\nbaseline_curve: [[1, 5, 3], [2, 7]]", {}, {}, "baseline_curve"),
    ("speculative: [http://x:1]\nbaseline_curve: fast", {}, {}, "bad curve point"),
])
def test_invalid_settings_name_the_problem(tmp_path, yaml_text, env, flags, needle):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_settings(str(cfg), flags, environ=env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_balanced_curves_from_yaml_env_and_flags(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("speculative: [http://s:1]\nbaseline: [http://b:1]\npolicy: balanced\n"
                   "speculative_curve: [[1, 141.7], [5, 340.7], [250, 604.2]]\nbaseline_curve: '1:92.6,2:159.7'\n")
    s = load_settings(str(cfg), {}, environ={})
    assert s.curves() == (((1, 141.7), (5, 340.7), (250, 604.2)), ((1, 92.6), (2, 159.7)))
    s = load_settings(str(cfg), {"speculative_curve": " 1:10, 2:15 "},
                      environ={"ROUTER_BASELINE_CURVE": "[[1, 9], [4, 30]]"})
    assert s.curves() == (((1, 10), (2, 15)), ((1, 9), (4, 30)))
    # Curves are optional for every other policy.
    assert load_settings(None, {"speculative": "http://s:1"}, environ={}).curves() is None


def test_unreadable_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings("/nonexistent/router.yaml", {}, environ={})


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=30,
                          cwd=ROOT, env=env)


@pytest.mark.parametrize("args", [
    ("serve",),
    ("serve", "--speculative", "http://127.0.0.1:1", "--threshold", "-3"),
    ("serve", "--speculative", "not a url"),
    ("serve", "--speculative", "http://127.0.0.1:1", "--policy", "nope"),
    ("serve", "--config", "/nonexistent.yaml"),
    ("serve", "--no-such-flag"),
    ("serve", "--speculative", "http://127.0.0.1:1", "--threshold", "many"),
    ("serve", "--speculative", "http://127.0.0.1:1", "--policy", "balanced"),
    ("serve", "--speculative", "http://127.0.0.1:1", "--policy", "balanced", "--speculative-curve", "1:5,x:3",
     "--baseline-curve", "1:2,2:3"),
    ("frobnicate",),
])
def test_cli_bad_config_is_one_line_exit_2(args):
    res = _cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spec-router: error:"), res.stderr
    assert "Traceback" not in res.stderr


def test_cli_help_documents_every_setting():
    res = _cli("serve", "--help")
    assert res.returncode == 0
    from router.settings import Settings
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in res.stdout
    assert _cli("--help").returncode == 0


def test_cli_port_in_use_is_one_line_exit_2():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = _cli("serve", "--speculative", "http://127.0.0.1:1", "--port", str(s.getsockname()[1]))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "cannot listen on 127.0.0.1" in res.stderr
    assert res.stdout == ""
