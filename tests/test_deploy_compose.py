"""Static checks of the compose stacks, .env.example and the router Dockerfile (no container engine needed)."""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SIM = ROOT / "docker-compose.sim.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE_COLOCATED = ROOT / "docker-compose.colocated.yml"
COMPOSE_FILES = [COMPOSE, COMPOSE_SIM, COMPOSE_COLOCATED]
SGLANG_PORT = 30000

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}; $$ is a literal dollar.
VAR_RE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def read_env_example() -> dict[str, str]:
    env: dict[str, str] = {}
    for n, raw in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f".env.example line {n} is not KEY=VALUE: {raw!r}"
        assert key not in env, f".env.example sets {key} twice"
        env[key] = value
    return env


def variables(text: str) -> list[re.Match[str]]:
    return list(VAR_RE.finditer(text.replace("$$", "")))


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose-style interpolation of every string in a loaded YAML tree."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        if op in (":-", ":?"):
            present = bool(env.get(name))
        else:
            present = name in env
        if present:
            return env[name]
        if op in (":?", "?"):
            raise AssertionError(f"required variable {name} is unset: {arg}")
        return arg if op else ""

    return VAR_RE.sub(sub, value.replace("$$", "\x00")).replace("\x00", "$")


def load_compose(path: Path, env: dict[str, str] | None = None) -> dict:
    """Load, interpolate and resolve `extends: {file, service}` (the local service's keys win)."""
    doc = interpolate(yaml.safe_load(path.read_text()), read_env_example() if env is None else env)
    for name, svc in doc["services"].items():
        ext = svc.pop("extends", None)
        if ext:
            base = load_compose(path.parent / ext["file"], env)["services"][ext["service"]]
            doc["services"][name] = {**base, **svc}
    return doc


def flags(command: list[str]) -> dict[str, str | None]:
    """--flag=value, --flag value and bare --flag of a launch command, in one dict."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(command):
        arg = str(command[i])
        if arg.startswith("--"):
            name, eq, val = arg.partition("=")
            if eq:
                out[name] = val
            elif i + 1 < len(command) and not str(command[i + 1]).startswith("--"):
                out[name] = str(command[i + 1])
                i += 1
            else:
                out[name] = None
        i += 1
    return out


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1, "one device request per SGLang service"
    dev = devices[0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "count" not in dev, "count and device_ids exclude each other"
    ids = [str(x) for x in dev["device_ids"]]
    assert all("," not in x for x in ids), "one device_ids entry per GPU"
    return ids


@pytest.fixture(scope="module")
def stack() -> dict:
    return load_compose(COMPOSE)["services"]


@pytest.fixture(scope="module")
def sim_stack() -> dict:
    return load_compose(COMPOSE_SIM)["services"]


# --- variables -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_variable_has_a_default_equal_to_env_example(path: Path) -> None:
    env = read_env_example()
    found = variables(path.read_text())
    assert found, f"{path.name} uses no variables at all"
    for m in found:
        name, op, arg = m.group("name"), m.group("op"), m.group("arg")
        assert "$" not in (arg or ""), f"{name}: nested defaults are mis-resolved by docker-compose 1.29"
        assert name in env, f"{path.name}: ${{{name}}} is not documented in .env.example"
        assert op == ":-", f"{path.name}: ${{{name}}} has no ':-' default"
        assert arg == env[name], f"{path.name}: default of {name} is {arg!r} but .env.example says {env[name]!r}"


def test_every_env_example_setting_is_used() -> None:
    used = {m.group("name") for p in COMPOSE_FILES for m in variables(p.read_text())}
    unused = set(read_env_example()) - used
    assert not unused, f".env.example documents settings no compose file reads: {sorted(unused)}"


def test_interpolation_honours_overrides() -> None:
    env = {**read_env_example(), "ROUTER_THRESHOLD": "7", "BASELINE_GPU3": "9"}
    services = load_compose(COMPOSE, env)["services"]
    assert services["router"]["environment"]["ROUTER_THRESHOLD"] == "7"
    assert gpu_ids(services["sglang-baseline"])[-1] == "9"


# --- the GPU stack ---------------------------------------------------------------------------------

def test_services_and_images(stack: dict) -> None:
    from bench.sim.protocol import SGLANG_VERSION

    assert {"sglang-speculative", "sglang-baseline", "router", "prometheus", "grafana"} <= set(stack)
    for name, svc in stack.items():
        assert "image" in svc or "build" in svc, f"{name} has neither image nor build"
        image = svc.get("image", "")
        assert not image.endswith(":latest") and ":" in image, f"{name}: image {image!r} is not pinned"
    for name in ("sglang-speculative", "sglang-baseline"):
        repo, _, tag = stack[name]["image"].partition(":")
        assert repo == "lmsysorg/sglang"
        # The simulator mirrors this release; CUDA 12 tags stopped at v0.5.19-cu129.
        assert re.fullmatch(rf"v{re.escape(SGLANG_VERSION)}(-cu13\d)?", tag), tag
    build = stack["router"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


def test_gpu_sets_are_disjoint_and_match_tp(stack: dict) -> None:
    spec, base = stack["sglang-speculative"], stack["sglang-baseline"]
    spec_ids, base_ids = gpu_ids(spec), gpu_ids(base)
    assert spec_ids == ["0", "1", "2", "3"]
    assert base_ids == ["4", "5", "6", "7"]
    assert not set(spec_ids) & set(base_ids)
    for svc, ids in ((spec, spec_ids), (base, base_ids)):
        f = flags(svc["command"])
        assert f["--tp"] == "4" == str(len(ids)), "TP size must equal the GPUs given to the server"
    for name, svc in stack.items():
        if name not in ("sglang-speculative", "sglang-baseline"):
            assert "deploy" not in svc, f"{name} must not reserve GPUs"


def test_launch_flags(stack: dict) -> None:
    spec, base = (flags(stack[n]["command"]) for n in ("sglang-speculative", "sglang-baseline"))
    for name in ("sglang-speculative", "sglang-baseline"):
        assert stack[name]["entrypoint"] == ["python3", "-m", "sglang.launch_server"]
    for f in (spec, base):
        assert "--enable-metrics" in f and f["--enable-metrics"] is None
        assert f["--host"] == "0.0.0.0"
        assert f["--port"] == str(SGLANG_PORT)
        assert f["--model-path"] and int(f["--max-running-requests"]) > 0
    assert spec["--model-path"] == base["--model-path"], "both pools serve the same model"
    assert spec["--served-model-name"] == base["--served-model-name"]
    assert spec["--speculative-algorithm"] == "EAGLE3"
    assert spec["--speculative-draft-model-path"]
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        assert int(spec[flag]) >= 1, flag
    # EAGLE servers are silently capped at 48 unless this is explicit; the router's threshold must fit.
    assert int(spec["--max-running-requests"]) >= 48
    assert not [f for f in base if f.startswith("--speculative")], "EAGLE flags leaked onto the baseline"


def test_sglang_runtime_settings(stack: dict) -> None:
    for name in ("sglang-speculative", "sglang-baseline"):
        svc = stack[name]
        assert svc["ipc"] == "host"
        assert any(str(v).endswith(":/root/.cache/huggingface") for v in svc["volumes"]), "HF cache volume"
        assert "HF_TOKEN" in svc["environment"]
        hc = svc["healthcheck"]
        assert f"localhost:{SGLANG_PORT}/health" in " ".join(hc["test"])
        assert parse_duration(hc["start_period"]) >= 600, "a large model needs minutes to load"
    raw = yaml.safe_load(COMPOSE.read_text())
    hf = raw["x-sglang"]["environment"]["HF_TOKEN"]
    assert hf.startswith("${HF_TOKEN"), "HF_TOKEN comes from the environment"


def parse_duration(text: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(text))
    assert parts and "".join(a + b for a, b in parts) == str(text), f"bad duration {text!r}"
    return sum(float(a) * units[b] for a, b in parts)


def test_router_service(stack: dict) -> None:
    from router.settings import load_settings

    router = stack["router"]
    deps = router.get("depends_on", {})
    conditions = deps.values() if isinstance(deps, dict) else []
    assert all(c.get("condition") != "service_healthy" for c in conditions), \
        "the router must start before the backends are healthy"
    env = {k: str(v) for k, v in router["environment"].items()}
    settings = load_settings(environ=env)  # raises ConfigError if compose hands it anything invalid
    assert settings.speculative == [f"http://sglang-speculative:{SGLANG_PORT}"]
    assert settings.baseline == [f"http://sglang-baseline:{SGLANG_PORT}"]
    assert settings.host == "0.0.0.0"
    assert settings.threshold == int(read_env_example()["ROUTER_THRESHOLD"])
    # The default policy learns from live traffic and reads the queue and accept length from /v1/loads.
    assert settings.policy == read_env_example()["ROUTER_POLICY"] == "adaptive"
    assert settings.load_signal == read_env_example()["ROUTER_LOAD_SIGNAL"] == "backend"
    spec = flags(stack["sglang-speculative"]["command"])
    assert settings.threshold <= int(spec["--max-running-requests"]), "threshold above the EAGLE server's batch cap"
    published = [str(p) for p in router["ports"]]
    assert published == [f"{read_env_example()['ROUTER_PORT']}:{settings.port}"]


def test_observability_services(stack: dict) -> None:
    graf = stack["grafana"]["environment"]
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["environment"]
    assert raw["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD")
    assert graf["GF_SECURITY_ADMIN_PASSWORD"]
    mounts = {str(v).split(":")[1] for v in stack["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/etc/grafana/dashboards"} <= mounts
    home = graf["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    host_dir = [v for v in stack["grafana"]["volumes"] if ":/etc/grafana/dashboards" in str(v)][0].split(":")[0]
    assert (ROOT / host_dir / Path(home).name).is_file()
    prom_cmd = stack["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom_cmd


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_mounted_file_exists(path: Path) -> None:
    services = load_compose(path)["services"]
    checked = 0
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith("."):
                assert (path.parent / src).exists(), f"{name} mounts missing {src}"
                checked += 1
    assert checked >= 3


def test_prometheus_scrapes_every_service(stack: dict) -> None:
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"router:8000", f"sglang-speculative:{SGLANG_PORT}", f"sglang-baseline:{SGLANG_PORT}"}
    pools = {sc["targets"][0]: sc.get("labels", {}).get("pool")
             for job in cfg["scrape_configs"] for sc in job["static_configs"]}
    assert pools[f"sglang-speculative:{SGLANG_PORT}"] == "speculative"
    assert pools[f"sglang-baseline:{SGLANG_PORT}"] == "baseline"
    for host in ("router", "sglang-speculative", "sglang-baseline"):
        assert host in stack


# --- the simulated stack ---------------------------------------------------------------------------

def test_sim_stack_replaces_only_the_gpu_servers(stack: dict, sim_stack: dict) -> None:
    assert set(sim_stack) == set(stack), "same service names, so the Prometheus config and router env apply"
    for name in ("sglang-speculative", "sglang-baseline"):
        svc = sim_stack[name]
        assert "deploy" not in svc, f"{name}: the simulated stack needs no GPU"
        assert svc["build"] == stack["router"]["build"] and svc["image"] == stack["router"]["image"]
        cmd = svc["command"]
        assert cmd[:4] == ["python", "-m", "bench", "sim"]
        f = flags(cmd)
        assert f["--host"] == "0.0.0.0" and f["--port"] == str(SGLANG_PORT)
    spec = flags(sim_stack["sglang-speculative"]["command"])
    base = flags(sim_stack["sglang-baseline"]["command"])
    from bench.sim.profiles import load_profile

    assert load_profile(spec["--profile"]).speculative
    assert not load_profile(base["--profile"]).speculative
    for name in ("router", "prometheus", "grafana"):
        assert sim_stack[name].get("image") == stack[name].get("image")
        assert sim_stack[name].get("environment") == stack[name].get("environment")


# --- the co-located stack (both servers TP8 on all eight GPUs) --------------------------------------

@pytest.fixture(scope="module")
def colocated_stack() -> dict:
    return load_compose(COMPOSE_COLOCATED)["services"]


def test_colocated_servers_share_all_eight_gpus_at_tp8(colocated_stack: dict) -> None:
    spec, base = colocated_stack["sglang-speculative"], colocated_stack["sglang-baseline"]
    assert gpu_ids(spec) == gpu_ids(base) == [str(i) for i in range(8)]
    fs, fb = flags(spec["command"]), flags(base["command"])
    for f in (fs, fb):
        assert f["--tp"] == "8", "each server decodes at full width"
        assert "--enable-metrics" in f and f["--port"] == str(SGLANG_PORT) and f["--host"] == "0.0.0.0"
    # two processes on the same GPUs: memory split, separate NCCL ports, the second loads after the first
    shares = float(fs["--mem-fraction-static"]), float(fb["--mem-fraction-static"])
    assert all(0.2 <= x for x in shares) and sum(shares) <= 0.9, shares
    assert fs["--nccl-port"] != fb["--nccl-port"]
    assert base["depends_on"]["sglang-speculative"]["condition"] == "service_healthy"
    assert fs["--speculative-algorithm"] == "EAGLE3" and int(fs["--max-running-requests"]) >= 48
    assert not [x for x in fb if x.startswith("--speculative")], "EAGLE flags leaked onto the baseline"
    assert fs["--model-path"] == fb["--model-path"] and fs["--served-model-name"] == fb["--served-model-name"]
    for name, svc in colocated_stack.items():
        if name not in ("sglang-speculative", "sglang-baseline"):
            assert "deploy" not in svc, f"{name} must not reserve GPUs"


def test_colocated_same_model_and_draft_as_the_split(stack: dict, colocated_stack: dict) -> None:
    skip = {"--tp", "--mem-fraction-static", "--nccl-port"}
    for name in ("sglang-speculative", "sglang-baseline"):
        split, colo = flags(stack[name]["command"]), flags(colocated_stack[name]["command"])
        assert {k: v for k, v in colo.items() if k not in skip} == {k: v for k, v in split.items() if k not in skip}
        assert colocated_stack[name]["image"] == stack[name]["image"]


def test_colocated_router_runs_global_with_hysteresis(colocated_stack: dict) -> None:
    from router.settings import load_settings

    env = {k: str(v) for k, v in colocated_stack["router"]["environment"].items()}
    settings = load_settings(environ=env)
    assert settings.policy == "global"
    assert settings.threshold == int(read_env_example()["COLOCATED_THRESHOLD"])
    assert 0 < settings.hysteresis < settings.threshold, "hysteresis keeps the mode from flapping"
    assert settings.speculative == [f"http://sglang-speculative:{SGLANG_PORT}"]
    assert settings.baseline == [f"http://sglang-baseline:{SGLANG_PORT}"]
    spec = flags(colocated_stack["sglang-speculative"]["command"])
    assert settings.threshold <= int(spec["--max-running-requests"])


def test_colocated_observability_as_the_main_stack(stack: dict, colocated_stack: dict) -> None:
    assert set(colocated_stack) == set(stack), "same service names, so the Prometheus config applies"
    for name in ("prometheus", "grafana"):
        assert colocated_stack[name] == stack[name]
    assert colocated_stack["router"]["image"] == stack["router"]["image"]


# --- docker-compose itself -------------------------------------------------------------------------

def compose_config(path: Path) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (scripts/install.sh installs it with apt)")
    proc = subprocess.run([exe, "--env-file", str(ENV_EXAMPLE), "-f", str(path), "config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_parses_and_agrees(path: Path) -> None:
    resolved = compose_config(path)["services"]
    mine = load_compose(path)["services"]
    assert set(resolved) == set(mine)
    for name, svc in mine.items():
        assert resolved[name].get("command") == svc.get("command"), name
        assert resolved[name].get("image") == svc.get("image"), name
        if "deploy" in svc:
            assert gpu_ids(resolved[name]) == gpu_ids(svc)
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        assert {k: str(v) for k, v in (resolved[name].get("environment") or {}).items()} == env


# --- the router image ------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_is_slim_non_root_runtime_only() -> None:
    ins = dockerfile_instructions()
    args = dict(r.split("=", 1) for op, r in ins if op == "ARG" and "=" in r)
    froms = [r.split()[0] for op, r in ins if op == "FROM"]
    images = {args.get(f[2:-1], f) if f.startswith("${") else f for f in froms}
    assert images and all(re.fullmatch(r"python:3\.11-slim(-\w+)?", i) for i in images), images
    users = [r for op, r in ins if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    installs = [r for op, r in ins if op == "RUN" and "pip install" in r]
    assert installs and all(re.search(r"pip install '\.\[epp\]'(\s|$|&)", r) for r in installs), installs
    # one extra only: the picker's gRPC stubs; no bench, peers, Envoy binary or test tools in the runtime image
    assert not any(x in r for r in installs for x in ("bench", "peers", "envoy", "dev")), installs
    cmd = json.loads([r for op, r in ins if op == "CMD"][-1])
    assert cmd == ["python", "-m", "router", "serve"]
    assert any(op == "HEALTHCHECK" and "/health" in r for op, r in ins)


def test_dockerfile_copies_existing_non_ignored_paths() -> None:
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    copies = [r for op, r in dockerfile_instructions() if op == "COPY" and not r.startswith("--from")]
    assert copies
    for rest in copies:
        *sources, _dest = rest.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist in the repository"
            assert src not in ignored and src.rstrip("/") not in ignored, f"{src} is excluded by .dockerignore"


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def third_party_imports(entry: str) -> dict[str, str]:
    """Top-level third-party modules reachable from `entry` through the project's own imports."""
    own = ("router", "bench")
    seen: set[str] = set()
    found: dict[str, str] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = _module_file(name)
        if path is None:
            continue
        parts = name.split(".")
        # importing a.b.c runs a/__init__ and a/b/__init__ too
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        pkg = name if path.name == "__init__.py" else ".".join(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                top = t.split(".")[0]
                if top in own:
                    todo.append(t)
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, f"{path.relative_to(ROOT)}")
    return found


# What the epp extra's packages are imported as: grpcio, grpcio-health-checking, xds-protos (and protobuf under it).
EPP_IMPORTS = {"grpc", "grpc_health", "envoy", "google", "xds", "udpa", "validate"}
RUNTIME_IMPORTS = {"aiohttp": "aiohttp", "uvloop": "uvloop", "prometheus-client": "prometheus_client",
                   "pydantic": "pydantic", "pydantic-settings": "pydantic_settings", "pyyaml": "yaml"}


@pytest.mark.parametrize("entry", ["router.__main__", "bench.__main__", "bench.sim.cli"])
def test_image_entry_points_need_only_runtime_dependencies(entry: str) -> None:
    if _module_file(entry) is None:
        pytest.fail(f"{entry} does not exist; the image runs it")
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=;!\[ ~]", d, maxsplit=1)[0].strip().lower() for d in deps}
    allowed = {RUNTIME_IMPORTS.get(n, n.replace("-", "_")) for n in names} | {"multidict", "yarl"}
    if entry == "router.__main__":
        # the image installs the epp extra for `python -m router epp` (deploy/Dockerfile)
        assert "pip install '.[epp]'" in (ROOT / "deploy" / "Dockerfile").read_text()
        allowed |= EPP_IMPORTS
    extra = {m: where for m, where in third_party_imports(entry).items() if m not in allowed}
    assert not extra, f"{entry} imports modules the runtime image lacks (pip install . has no extras): {extra}"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_published_ports_are_distinct_and_sglang_stays_on_loopback(path: Path) -> None:
    published: dict[str, str] = {}
    for name, svc in load_compose(path)["services"].items():
        for spec in svc.get("ports", []):
            parts = str(spec).split(":")
            host_port = parts[-2]
            assert host_port not in published, f"{name} and {published.get(host_port)} both publish {host_port}"
            published[host_port] = name
            if name.startswith("sglang-"):
                assert parts[0] == "127.0.0.1" and parts[-1] == str(SGLANG_PORT), spec
    assert set(published.values()) == {"router", "prometheus", "grafana", "sglang-speculative", "sglang-baseline"}
