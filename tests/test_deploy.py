"""deploy/'s Kubernetes manifests: valid against Kubernetes' own schemas, and consistent with the server they run."""

from __future__ import annotations

from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from server.settings import FLAGS, parse
from tests.server_harness import serve

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES_VERSION = "1.33.0"  # a release current clusters run; the validator bundles its schemas


def documents() -> list[dict]:
    return [doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict:
    (found,) = [doc for doc in documents() if doc["kind"] == kind]
    return found


def container() -> dict:
    (found,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    return found


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_manifest_is_valid_kubernetes(doc):
    # strict: a misspelt or misplaced field is an error, not silently ignored by the cluster
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    broken = by_kind("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_container_runs_as_the_images_non_root_user():
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    uid = next(line for line in (DEPLOY.parent / "Dockerfile").read_text().splitlines() if line.startswith("USER "))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid.split()[1]


def test_the_environment_is_settings_the_server_reads(monkeypatch):
    env = {item["name"]: item["value"] for item in container()["env"]}
    flags = {f"KVSERVE_{name.upper()}" for name, _, _ in FLAGS} | {"KVSERVE_HOME"}
    assert set(env) <= flags, f"not read by the server: {set(env) - flags}"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = parse([])
    (port,) = container()["ports"]
    assert settings.port == port["containerPort"]
    assert by_kind("Service")["spec"]["ports"][0]["targetPort"] == port["name"]
    assert by_kind("Service")["spec"]["selector"] == by_kind("Deployment")["spec"]["selector"]["matchLabels"]


def test_probes_and_the_autoscaled_metric_exist_on_the_real_server(tiny_dir):
    probes = {container()[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    (metric,) = by_kind("HorizontalPodAutoscaler")["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name in (DEPLOY / "prometheus-adapter.yaml").read_text()
    with serve(tiny_dir, max_seq_len=128) as server:
        url = server.url
        for path in probes:
            assert httpx.get(url + path).status_code == 200
        exported = [line.split()[0] for line in httpx.get(url + "/metrics").text.splitlines() if not line.startswith("#")]
        assert name in exported
