"""docker-compose.yml, the Dockerfile and deploy/k8s: they parse, and every command, flag,
environment variable, port and health check they use exists in the CLI and agrees with the
rest (probes hit the port the process listens on, addresses name real services)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.app import create_app
from gateway.config import GatewayConfig
from pagedserve import envs
from pagedserve.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# Variables read outside argparse: the environment switches.
NON_FLAG_ENV = {entry.name for entry in envs.registry()}
GATEWAY_ROUTES = set(create_app(GatewayConfig()).openapi()["paths"])


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def option_strings(command: str) -> set[str]:
    return {s for a in subcommands()[command]._actions for s in a.option_strings}


def parse(argv: list[str], env: dict[str, str], mp: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parses argv the way the container would, with its environment applied."""
    import os

    with mp.context() as m:
        for key in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        command = argv[0]
        for key in env:
            if key.startswith("PAGEDSERVE_") and key not in NON_FLAG_ENV:
                flag = "--" + key.removeprefix("PAGEDSERVE_").lower().replace("_", "-")
                assert flag in option_strings(command), f"{key}: `{command}` has no {flag}"
        return build_parser().parse_args(argv)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def dockerfile_targets() -> set[str]:
    text = (ROOT / "Dockerfile").read_text()
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, flags=re.MULTILINE | re.IGNORECASE))


def test_the_package_ships_the_c_sources() -> None:
    from gpu_worker import cpu_kernels
    from gpu_worker.attention import cpu_decode, cpu_prefill
    from gpu_worker.models import fused_ops

    with open(ROOT / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["gpu_worker"]
    shipped = {p.resolve() for g in globs for p in (ROOT / "gpu_worker").glob(g)}
    headers = set(cpu_kernels.INCLUDE_DIR.glob("*.h"))
    assert headers
    for source in (cpu_decode.SOURCE, cpu_prefill.SOURCE, fused_ops.SOURCE, *headers):
        assert source.resolve() in shipped


def test_dockerfile_targets_and_entrypoint() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert {"cpu", "cuda"} <= dockerfile_targets()
    assert text.count('ENTRYPOINT ["pagedserve"]') == 2
    for cmd in re.findall(r"^CMD (\[.*\])$", text, flags=re.MULTILINE):
        build_parser().parse_args(yaml.safe_load(cmd))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# -- docker compose -------------------------------------------------------------------------------


def _interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with nothing set: the default; ${VAR:?error} (required): a
    stand-in value."""
    if isinstance(value, str):
        value = re.sub(r"\$\{([A-Z_]+):\?[^}]*\}", r"required-\1", value)
        return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _load_compose(*files: str) -> dict[str, Any]:
    """The files merged as `docker compose -f a -f b` does for what they hold: mappings merge
    key by key, anything else is replaced."""

    def merge(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {
                k: merge(a[k], b[k]) if k in a and k in b else b.get(k, a.get(k)) for k in a | b
            }
        return b

    data: dict[str, Any] = {}
    for f in files:
        data = merge(data, yaml.safe_load((ROOT / f).read_text()))
    out = _interpolate(data)
    assert isinstance(out, dict)
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_compose("docker-compose.yml")


@pytest.fixture(scope="module")
def compose_gpu() -> dict[str, Any]:
    return _load_compose("docker-compose.yml", "docker-compose.gpu.yml")


@pytest.mark.parametrize("variant", ["compose", "compose_gpu"])
def test_compose_services_commands_and_health(
    variant: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = request.getfixturevalue(variant)["services"]
    assert {"redis", "worker", "control-plane", "gateway"} == set(services)
    parsed: dict[str, argparse.Namespace] = {}
    for name, svc in services.items():
        if not str(svc.get("image", "")).startswith("pagedserve"):
            continue
        assert svc["build"]["target"] in dockerfile_targets()
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        args = parse(svc["command"], env, monkeypatch)
        parsed[name] = args
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "pagedserve", "healthcheck"], name
        check = build_parser().parse_args(test[2:])
        if args.command == "gateway":
            url = f"http://127.0.0.1:{args.port}/health"
            assert check.http == url and "/health" in GATEWAY_ROUTES
            assert any(str(p).endswith(f":{args.port}") for p in svc["ports"])
        else:
            assert check.grpc == f"127.0.0.1:{args.port}", name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"

    # Addresses point at services on the ports they listen on.
    cp = parsed["control-plane"]
    for address in cp.workers.split(","):
        host, port = host_port(address)
        assert parsed[host].port == port
    assert re.fullmatch(r"redis://redis:6379/\d+", cp.redis_url)
    assert parsed["gateway"].control_plane == f"control-plane:{cp.port}"
    assert parsed["worker"].device == ("cpu" if variant == "compose" else "cuda")


def test_compose_passes_a_required_grpc_token_to_every_pagedserve_service() -> None:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = {n: s for n, s in raw["services"].items() if s["image"].startswith("pagedserve")}
    assert {"worker", "control-plane", "gateway"} <= set(services)
    for name, svc in services.items():
        token = svc["environment"]["PAGEDSERVE_GRPC_TOKEN"]
        # Required (no default): compose refuses to start without it.
        assert re.fullmatch(r"\$\{PAGEDSERVE_GRPC_TOKEN:\?[^}]+\}", token), name
    # The .env that holds it stays out of git and of the image's build context.
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_compose_worker_runs_on_cpu_without_a_profile_and_the_gpu_file_moves_it(
    compose: dict[str, Any], compose_gpu: dict[str, Any]
) -> None:
    cpu, gpu = compose["services"]["worker"], compose_gpu["services"]["worker"]
    assert "profiles" not in cpu and "deploy" not in cpu
    assert not any("profiles" in s for s in compose["services"].values())
    # No swap pool on CPU by default (it would copy KV blocks within the same RAM).
    assert cpu["environment"]["PAGEDSERVE_SWAP_SPACE"] == "0"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["build"]["target"] == "cuda" and gpu["environment"]["PAGEDSERVE_SWAP_SPACE"]
    assert gpu["environment"]["PAGEDSERVE_GRPC_TOKEN"]  # kept from the base file
    # An explicit KV size would hold on CUDA too: the GPU worker's pool must come from
    # --gpu-memory-utilization, so neither file sets one.
    assert "PAGEDSERVE_KV_CACHE_MEMORY" not in gpu["environment"]
    deps = compose["services"]["control-plane"]["depends_on"]
    assert deps["worker"] == {"condition": "service_healthy"}


def test_each_gpu_worker_container_gets_gpus_of_its_own(
    compose_gpu: dict[str, Any], manifests: list[dict[str, Any]]
) -> None:
    """Docker answers a device request for `count: N` with the first N GPUs, so worker
    containers that each asked for `count: 1` would all run on GPU 0: compose names each
    worker's GPUs by id, one per tensor-parallel rank, no id in two workers. Kubernetes' device
    plugin gives each pod GPUs no other pod holds: a worker pod asks for one per rank."""
    seen: list[str] = []
    workers = [s for s in compose_gpu["services"].values() if s["command"][0] == "worker"]
    assert workers
    for svc in workers:
        [request] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in request
        ids = [str(i) for i in request["device_ids"]]
        # (as compose reads it with the variable unset)
        assert len(ids) == int(svc["environment"]["PAGEDSERVE_TENSOR_PARALLEL_SIZE"])
        seen += ids
    assert len(seen) == len(set(seen))

    tp_size = int(
        _by_kind(manifests, "ConfigMap")["pagedserve-worker"]["data"][
            "PAGEDSERVE_TENSOR_PARALLEL_SIZE"
        ]
    )
    sts = _by_kind(manifests, "StatefulSet")["pagedserve-worker"]
    resources = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    assert resources["limits"]["nvidia.com/gpu"] == tp_size


# -- kubernetes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == files
    docs = [d for f in files for d in yaml.safe_load_all((K8S / f).read_text()) if d]
    assert all({"apiVersion", "kind", "metadata"} <= set(d) for d in docs)
    return docs


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_k8s_containers_flags_ports_and_probes(
    manifests: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config_maps = _by_kind(manifests, "ConfigMap")
    services = _by_kind(manifests, "Service")
    workloads = {**_by_kind(manifests, "Deployment"), **_by_kind(manifests, "StatefulSet")}
    parsed: dict[str, argparse.Namespace] = {}
    for name, w in workloads.items():
        pod = w["spec"]["template"]
        labels = pod["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for c in pod["spec"]["containers"]:
            ports = {p["containerPort"] for p in c["ports"]}
            # A Service selects these pods and forwards to a port the container exposes.
            assert any(
                s["spec"]["selector"].items() <= labels.items()
                and all(p["targetPort"] in ports for p in s["spec"]["ports"])
                for s in services.values()
            ), name
            if not c["image"].startswith("pagedserve"):
                continue
            env: dict[str, str] = {}
            for ref in c.get("envFrom", []):
                env.update(config_maps[ref["configMapRef"]["name"]]["data"])
            for var in c.get("env", []):
                env[var["name"]] = "secret"
            args = parse(c["args"], env, monkeypatch)
            parsed[args.command] = args
            assert args.port in ports
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                spec = c.get(probe)
                if spec is None:
                    continue
                if args.command == "gateway":
                    target = spec.get("httpGet") or spec["tcpSocket"]
                    if "path" in target:
                        assert target["path"] in GATEWAY_ROUTES
                else:
                    target = spec["grpc"]  # the standard grpc.health.v1 service
                assert target["port"] == args.port, f"{name} {probe}"
            assert "readinessProbe" in c and "livenessProbe" in c
    assert set(parsed) == {"worker", "control-plane", "gateway"}

    # The control plane lists every StatefulSet pod by its stable name.
    sts = _by_kind(manifests, "StatefulSet")["pagedserve-worker"]
    headless = services[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    expected = [
        f"pagedserve-worker-{i}.{headless['metadata']['name']}:{parsed['worker'].port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert parsed["control-plane"].workers.split(",") == expected
    limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    # Addresses name Services on their ports.
    cp_host, cp_port = host_port(parsed["gateway"].control_plane)
    assert services[cp_host]["spec"]["ports"][0]["port"] == cp_port == parsed["control-plane"].port
    redis = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", parsed["control-plane"].redis_url)
    assert redis is not None
    assert services[redis[1]]["spec"]["ports"][0]["port"] == int(redis[2])


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels selectors are checked here"
    return bool(selector["matchLabels"].items() <= labels.items())


def test_k8s_network_policies_let_in_only_the_next_hop_up(
    manifests: list[dict[str, Any]],
) -> None:
    """Control plane <- gateways only, workers <- control plane only, Redis <- control plane
    only, each on its container port; the gateway (the public edge) keeps open ingress."""
    workloads = {**_by_kind(manifests, "Deployment"), **_by_kind(manifests, "StatefulSet")}
    pods = {n: w["spec"]["template"]["metadata"]["labels"] for n, w in workloads.items()}
    ports = {
        n: {p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]}
        for n, w in workloads.items()
    }  # fmt: skip
    allowed = {
        "pagedserve-control-plane": "pagedserve-gateway",
        "pagedserve-worker": "pagedserve-control-plane",
        "pagedserve-redis": "pagedserve-control-plane",
    }
    policies = _by_kind(manifests, "NetworkPolicy")
    guarded: dict[str, str] = {}
    for name, policy in policies.items():
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        spec = policy["spec"]
        assert "Ingress" in spec["policyTypes"], name
        [target] = [n for n, labels in pods.items() if _selects(spec["podSelector"], labels)]
        [rule] = spec["ingress"]
        sources = {
            n for peer in rule["from"] for n, labels in pods.items()
            if set(peer) == {"podSelector"} and _selects(peer["podSelector"], labels)
        }  # fmt: skip
        assert len(sources) == len(rule["from"]) == 1, f"{name}: only pod selectors, one each"
        [source] = sources
        assert {p["port"] for p in rule["ports"]} == ports[target], name
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        guarded[target] = source
    assert guarded == allowed
    assert not any(_selects(p["spec"]["podSelector"], pods["pagedserve-gateway"])
                   for p in policies.values())  # fmt: skip


def test_k8s_pods_get_the_grpc_token_from_one_required_secret(
    manifests: list[dict[str, Any]],
) -> None:
    workloads = {**_by_kind(manifests, "Deployment"), **_by_kind(manifests, "StatefulSet")}
    refs = {}
    for name, w in workloads.items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if not c["image"].startswith("pagedserve"):
                continue
            [var] = [v for v in c.get("env", []) if v["name"] == "PAGEDSERVE_GRPC_TOKEN"]
            ref = var["valueFrom"]["secretKeyRef"]
            assert not ref.get("optional", False), f"{name}: the token must not be optional"
            refs[c["args"][0]] = (ref["name"], ref["key"])
    assert set(refs) == {"worker", "control-plane", "gateway"}
    [(secret, key)] = set(refs.values())
    # The README says how to create it.
    readme = (K8S / "README.md").read_text()
    assert f"kubectl create secret generic {secret} --from-literal={key}=" in readme


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_k8s_kustomize_builds() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    images = {
        c["image"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert {"pagedserve:cpu", "pagedserve:cuda"} <= images


def test_k8s_every_pod_has_requests_limits_and_patient_probes(
    manifests: list[dict[str, Any]],
) -> None:
    workloads = {**_by_kind(manifests, "Deployment"), **_by_kind(manifests, "StatefulSet")}
    for name, w in workloads.items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            resources = c["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name} {kind}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:  # a loaded node answers late: the 1 s default fails probes
                    assert c[probe].get("timeoutSeconds", 1) >= 5, f"{name} {probe}"


def test_k8s_control_plane_probes_agree_with_its_startup_wait(
    manifests: list[dict[str, Any]],
) -> None:
    [c] = _by_kind(manifests, "Deployment")["pagedserve-control-plane"]["spec"]["template"]["spec"][
        "containers"
    ]
    env = _by_kind(manifests, "ConfigMap")["pagedserve-control-plane"]["data"]
    wait = float(env["PAGEDSERVE_WORKER_CONNECT_TIMEOUT"])
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= wait > 0
    # Liveness asks only whether the process runs; readiness whether a worker answers.
    assert c["livenessProbe"]["grpc"]["service"] == "liveness"
    assert "service" not in c["readinessProbe"]["grpc"]
