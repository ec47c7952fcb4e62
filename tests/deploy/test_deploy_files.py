"""The shipped deployment files are valid for the tools that consume them and name only real options.

Images cannot be built here (no container daemon), so the Dockerfile is linted with hadolint; the
Kubernetes manifests are validated offline against the API schemas; the systemd unit is checked by
systemd-analyze; every kvserver flag and config key the files use must exist in `kvserver start`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserver.cli import start
from kvserver.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
K8S = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _flags() -> set[str]:
    return {opt for p in start.params for opt in p.opts if opt.startswith("--")}


def _kvserver_args(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def test_dockerfile_passes_hadolint() -> None:
    res = _run([str(BIN / "hadolint"), "--failure-threshold", "info", str(DEPLOY / "docker" / "Dockerfile")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_runs_as_non_root_without_torch() -> None:
    lines = (DEPLOY / "docker" / "Dockerfile").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    final_stage = text.rsplit("FROM ", 1)[1]
    assert "USER 10001" in final_stage
    assert "torch" not in text and "kvconnector" not in text


@pytest.mark.parametrize("manifest", K8S, ids=[m.name for m in K8S])
def test_kubernetes_manifests_validate(manifest: Path) -> None:
    for version in ("1.30.0", "1.37.0"):  # native sidecars need >= 1.29
        res = _run([str(BIN / "kubernetes-validate"), "--strict", "-k", version, str(manifest)])
        assert res.returncode == 0, res.stdout + res.stderr


def _containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        out += spec.get("containers", []) + spec.get("initContainers", [])
    return out


def test_kubernetes_kvserver_options_exist_and_shm_is_shared() -> None:
    docs = [d for m in K8S for d in yaml.safe_load_all(m.read_text()) if d]
    kv = [c for c in _containers(docs) if c["image"].startswith("kvserver:")]
    assert len(kv) == 2
    for c in kv:
        assert set(_kvserver_args(c["args"])) <= _flags()
        assert any(v["mountPath"] == "/dev/shm" for v in c["volumeMounts"])
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    # Every key is a real option (the token comes from the Secret through the environment).
    ServerConfig(**tomllib.loads(config["data"]["kvserver.toml"]), api_token="from-the-secret")
    # Engines and the server share the arena's directory and UID.
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is not None:
            assert pod["securityContext"]["runAsUser"] == 10001
            shm = [v for v in pod["volumes"] if v["name"] == "shm"]
            assert shm and ("hostPath" in shm[0] or shm[0]["emptyDir"]["medium"] == "Memory")


def test_the_daemonset_keeps_the_arena_across_a_rollout() -> None:
    """The DaemonSet's arena lives in a node directory, not in the pod: a rollout's new pod adopts it
    (warm restart). An emptyDir would be deleted with the old pod, and the cache with it."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "kvserver-daemonset.yaml").read_text()) if d]
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["hostPath"]["path"].startswith("/dev/shm/")
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert not tomllib.loads(config["data"]["kvserver.toml"]).get("cold", False)


def test_the_systemd_unit_keeps_the_arena_across_a_restart() -> None:
    """systemd removes a user's POSIX shared memory when its service stops under RemoveIPC= (implied
    by DynamicUser=), and PrivateDevices= gives the service a /dev/shm of its own that dies with it:
    either would throw the arena away at every restart."""
    unit = (DEPLOY / "systemd" / "kvserver.service").read_text()
    settings = {
        line.split("=", 1)[0].strip(): line.split("=", 1)[1].strip()
        for line in unit.splitlines()
        if "=" in line and not line.startswith("#")
    }
    assert settings.get("RemoveIPC", "no") == "no" and settings.get("DynamicUser", "no") == "no"
    assert settings.get("PrivateDevices", "no") == "no" and settings.get("PrivateIPC", "no") == "no"
    assert "/dev/shm" in settings["ReadWritePaths"].split()


def test_compose_wires_vllm_to_the_server_arena() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(_kvserver_args(services["kvserver"]["command"])) <= _flags()
    assert services["kvserver"]["ipc"] == "shareable"
    assert services["vllm"]["ipc"] == "service:kvserver"
    assert services["vllm"]["user"] == services["kvserver"]["user"]
    assert services["vllm"]["environment"]["KVSERVER_URL"].endswith(":5555")


def test_compose_prometheus_scrapes_with_the_server_token() -> None:
    """Without the token /metrics has no per-tenant series: Prometheus gets it as a compose secret."""
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text())
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())["scrape_configs"]
    job = next(j for j in scrape if j["job_name"] == "kvserver")
    secret = job["authorization"]["credentials_file"].removeprefix("/run/secrets/")
    assert secret in compose["services"]["prometheus"]["secrets"]
    assert compose["secrets"][secret]["environment"] == "KVSERVER_API_TOKEN"
    assert compose["services"]["kvserver"]["environment"]["KVSERVER_API_TOKEN"].startswith("${KVSERVER_API_TOKEN")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze (Debian: systemd) is missing")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = (DEPLOY / "systemd" / "kvserver.service").read_text()
    assert "/opt/kvserver/bin/kvserver start" in unit
    local = tmp_path / "kvserver.service"  # the unit's binary path, pointed at this checkout's kvserver
    local.write_text(unit.replace("/opt/kvserver/bin/kvserver", str(BIN / "kvserver")))
    res = _run(["systemd-analyze", "verify", str(local)])
    assert res.returncode == 0, res.stdout + res.stderr
