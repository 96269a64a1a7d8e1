"""Kubernetes manifests (deploy/k8s): validated offline with kubernetes-validate (when
importable), and consistent with one another (labels, ports, probes, secrets, the router)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.artifact_support import DEPLOY

K8S = DEPLOY / "k8s"


def k8s_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def test_k8s_manifests_validate_offline():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (test extra)"
    )
    version = kubernetes_validate.latest_version()
    builtin = ("Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy")
    for kind, doc in k8s_docs().items():
        if kind in builtin:
            kubernetes_validate.validate(doc, version, strict=True)
    assert set(builtin) <= k8s_docs().keys()


def test_k8s_manifests_fit_together():
    docs = k8s_docs()
    deployment, service = docs["Deployment"], docs["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "--host" in container["args"] and "0.0.0.0" in container["args"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["model-cache"] == "/home/specd/.cache"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert mounts["tmp"] == "/tmp"  # the one place a read-only root leaves to write
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    env = {e["name"]: e for e in container["env"]}
    key = env["SPECD_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "specd-secrets", "key": "api-key"}  # not optional: no keyless pod
    assert {v["name"] for v in pod["volumes"]} >= set(mounts)

    assert service["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names

    monitor = docs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service_labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service_labels.items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == key  # /metrics asks for the key too
    assert service["metadata"]["name"] == "specd"  # job="specd" in rules.yml

    hpa = docs["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "specd_requests_waiting"

    kustomization = docs["Kustomization"]
    (image,) = kustomization["images"]
    assert image["name"] == container["image"].split()[0] and re.fullmatch(r"sha256:[0-9a-f]{64}", image["digest"])
    assert "newTag" not in image  # by digest, never by a tag that can move
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_network_policy_admits_kv_events_from_the_router_alone():
    docs = k8s_docs()
    policy = docs["NetworkPolicy"]
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # selected: anything not listed is refused
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    api_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    rules = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["spec"]["ingress"]}
    assert set(rules) == {api_port, 5557}
    router = yaml.safe_load_all((K8S / "router" / "router.yaml").read_text())
    router_labels = next(d for d in router if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    (source,) = rules[5557]
    assert source["podSelector"]["matchLabels"].items() <= router_labels.items()


def test_k8s_router_manifests_validate_and_select_the_specd_pods():
    docs = {}
    for doc in yaml.safe_load_all((K8S / "router" / "router.yaml").read_text()):
        docs[doc["kind"]] = doc
    assert set(docs) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    for doc in docs.values():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    args = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    specd_labels = k8s_docs()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    key, _, value = args[args.index("--selector") + 1].partition("=")
    assert specd_labels[key] == value and "--policy=cache_aware" in args
    kustomization = yaml.safe_load((K8S / "router" / "kustomization.yaml").read_text())
    assert kustomization["images"][0]["digest"].startswith("sha256:")


def test_the_router_pod_can_start_as_non_root_with_no_capabilities():
    """runAsNonRoot needs a numeric user to verify: the image's USER or the pod's runAsUser."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((K8S / "router" / "router.yaml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert isinstance(pod["securityContext"]["runAsUser"], int) and pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for dockerfile in (DEPLOY / "router" / "Dockerfile", DEPLOY / "Dockerfile"):
        users = re.findall(r"^USER (\S+)$", dockerfile.read_text(), re.M)
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) > 0, (dockerfile, users)
