"""deploy/k8s: schema-valid manifests whose probes, timings and alerts fit together.

Schemas: kubernetes-validate (the API's own OpenAPI, strict: unknown fields are errors)
for built-in kinds; deploy/k8s/schemas/ for the Prometheus Operator kinds, KEDA's
ScaledObject and prometheus-adapter's rules (the autoscaling components).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from embedserve.config import Settings
from tests.conftest import tool_missing

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# The oldest release the manifests need (PDB unhealthyPodEvictionPolicy is GA in 1.31)
# and the newest the validator knows.
K8S_VERSIONS = ["1.31.0", "1.37.0"]
COLD_JIT_START_S = 290  # docs: FlashInfer JIT cold start 250-290 s


def _load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _resources() -> list[tuple[str, dict[str, Any]]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [(f, d) for f in kust["resources"] for d in _load(f)]


def _one(kind: str, component: str | None = None) -> dict[str, Any]:
    """The one object of a kind (of that app.kubernetes.io/component, when given)."""
    found = [
        d
        for _, d in _resources()
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"{kind}: {len(found)}"
    return found[0]


def _server() -> dict[str, Any]:
    return _one("Deployment", "server")


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_prometheusrule", K8S / "gen_prometheusrule.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _containers() -> dict[str, dict[str, Any]]:
    pod = _server()["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _env(container: dict[str, Any]) -> dict[str, str]:
    cm = _one("ConfigMap")["data"]
    env = dict(cm) if container.get("envFrom") else {}
    env.update({e["name"]: e.get("value", "<ref>") for e in container.get("env", [])})
    return env


# ------------------------------------------------------------------ schemas


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_strictly(version):
    kv = pytest.importorskip("kubernetes_validate")
    checked = 0
    for fname, doc in _resources():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(
                f"{fname} {doc['kind']}/{doc['metadata']['name']}: {e.message} at "
                f"{'/'.join(map(str, e.absolute_path))}"
            )
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("kind", ["PrometheusRule", "PodMonitor"])
def test_operator_kinds_validate(kind):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((K8S / "schemas" / f"{kind.lower()}-monitoring-v1.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    found = [d for _, d in _resources() if d["kind"] == kind]
    assert found
    for doc in found:
        jsonschema.validate(doc, schema)


def test_vendored_rule_schema_rejects_typos():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((K8S / "schemas" / "prometheusrule-monitoring-v1.json").read_text())
    bad = json.loads(json.dumps(_one("PrometheusRule")))
    bad["spec"]["groups"][0]["rules"][0]["exprr"] = "1"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_kubectl_kustomize_builds_if_available():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "unknown command" in r.stderr:
        pytest.skip("this kubectl has no kustomize")
    assert r.returncode == 0, r.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(r.stdout) if d}
    assert {"Deployment", "PodDisruptionBudget", "PrometheusRule"} <= kinds
    assert all(
        d["metadata"].get("namespace") == "embedserve"
        for d in yaml.safe_load_all(r.stdout)
        if d and d["kind"] != "Namespace"
    )


# ------------------------------------------------------------------ probes and timings


def test_probes_hit_our_health_endpoints_with_fitting_timeouts():
    c = _containers()
    engine, gateway = c["engine"], c["gateway"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": 8000}
    # Liveness restarts the container that holds the memory, the engine, on the gateway's
    # verdict; a gateway that does not answer passes it (tests/test_docs.py runs the script).
    assert engine["livenessProbe"]["exec"]["command"] == [
        "python3", "/usr/local/lib/embedserve/healthcheck.py", "engine-verdict", "2"]
    assert engine["livenessProbe"]["timeoutSeconds"] > 2  # the script's own timeout fits inside
    for probe in (gateway["readinessProbe"], engine["livenessProbe"]):
        # Our probes answer from memory in < 50 ms; 2 s tolerates a busy node, and is
        # still far from SGLang's ~1 s forward-pass /health that made pods flap.
        assert 1 <= probe["timeoutSeconds"] <= 5
        assert probe["periodSeconds"] >= probe["timeoutSeconds"]
    # Never SGLang's /health (a forward pass) in a kubelet probe.
    for cont in c.values():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert cont.get(kind, {}).get("httpGet", {}).get("path") != "/health"


def test_startup_budget_covers_a_cold_jit_start():
    sp = _containers()["engine"]["startupProbe"]
    budget = sp["periodSeconds"] * sp["failureThreshold"]
    assert budget >= 2 * COLD_JIT_START_S
    # Liveness only takes over after startup succeeded, so a slow boot is never killed.
    assert "initialDelaySeconds" not in _containers()["engine"]["livenessProbe"]


def _prestop_s(container: dict[str, Any]) -> int:
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    return int(cmd[1])


def test_drain_fits_in_the_grace_period():
    pod = _server()["spec"]["template"]["spec"]
    c = _containers()
    grace = pod["terminationGracePeriodSeconds"]
    drain = float(_env(c["gateway"])["EMBEDSERVE_GATEWAY__GRACEFUL_SHUTDOWN_S"])
    gateway_done = _prestop_s(c["gateway"]) + drain
    assert _prestop_s(c["gateway"]) >= 5  # endpoints propagate before SIGTERM
    # The engine keeps serving until the gateway has drained, and all ends before SIGKILL.
    assert _prestop_s(c["engine"]) >= gateway_done
    assert grace > _prestop_s(c["engine"]) + 10
    assert grace > gateway_done


def test_rolling_update_and_pdb():
    dep = _server()
    strat = dep["spec"]["strategy"]
    assert strat["type"] == "RollingUpdate"
    assert strat["rollingUpdate"]["maxUnavailable"] == 1
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert _one("Service")["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_one_gpu_per_pod_and_jit_cache_on_a_volume():
    engine = _containers()["engine"]
    res = engine["resources"]
    assert res["requests"]["nvidia.com/gpu"] == 1 and res["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    pod = _server()["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    claim = vols[mounts["/cache"]]["persistentVolumeClaim"]["claimName"]
    pvcs = {d["metadata"]["name"]: d for _, d in _resources() if d["kind"] == "PersistentVolumeClaim"}
    assert claim in pvcs
    assert _env(engine)["EMBEDSERVE_ENGINE__FLASHINFER_CACHE_DIR"].startswith("/cache/")


def test_stats_dir_shared_between_engine_and_gateway():
    c = _containers()
    pod = _server()["spec"]["template"]["spec"]
    stats = {n: _env(x)["EMBEDSERVE_ENGINE__STATS_DIR"] for n, x in c.items()}
    assert len(set(stats.values())) == 1
    path = next(iter(stats.values()))
    vols = {n: next(m["name"] for m in x["volumeMounts"] if m["mountPath"] == path) for n, x in c.items()}
    assert len(set(vols.values())) == 1
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[vols["engine"]]
    # The stats files name engine PIDs: the gateway must see the engine's processes.
    assert pod["shareProcessNamespace"] is True
    gw = _env(c["gateway"])
    assert json.loads(gw["EMBEDSERVE_ENGINE__URLS"]) == ["http://127.0.0.1:30000"]
    assert gw["EMBEDSERVE_ENGINE__KIND"] == "external"
    # The gateway takes its engine's defaults without waiting for it to answer: it names its kind.
    assert gw["EMBEDSERVE_ENGINE__EXTERNAL_KIND"] == _env(c["engine"])["EMBEDSERVE_ENGINE__KIND"]


def test_settings_in_the_manifests_parse(monkeypatch):
    from embedserve.config import Settings

    for name, container in _containers().items():
        for k, v in _env(container).items():
            if v != "<ref>":
                monkeypatch.setenv(k, v)
        s = Settings(_env_file=None)
        assert s.health.warning_hours > s.health.critical_hours, name


# ------------------------------------------------------------------ restart controller


def _controller() -> dict[str, Any]:
    return _one("Deployment", "restart-controller")


def test_controller_selects_serving_pods_only_and_may_evict():
    dep = _controller()
    # one controller at a time, also during its own rollout
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    job_pod = dep["spec"]["template"]
    ctr = job_pod["spec"]["containers"][0]
    assert ctr["command"][:2] == ["embedserve", "restart-controller"] and "--once" not in ctr["command"]
    env = {e["name"]: e["value"] for e in ctr["env"]}
    selector = dict(kv.split("=") for kv in env["EMBEDSERVE_CONTROLLER__LABEL_SELECTOR"].split(","))
    server_labels = _server()["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= server_labels.items()
    assert not selector.items() <= job_pod["metadata"]["labels"].items()
    assert env["EMBEDSERVE_CONTROLLER__DEPLOYMENT"] == _server()["metadata"]["name"]
    role = _one("Role")
    rules = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {("pods", "list"), ("pods/eviction", "create")} <= rules
    assert not any(v in ("delete", "*") for _, v in rules)  # evict, never delete
    binding = _one("RoleBinding")
    sa = job_pod["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == sa == _one("ServiceAccount")["metadata"]["name"]
    # Threshold: the controller reads the same configmap as the probes.
    assert ctr["envFrom"][0]["configMapRef"]["name"] == _one("ConfigMap")["metadata"]["name"]


def test_controller_may_make_every_call_of_a_surge():
    """The Role covers what service/controller/kube.py asks of each owner of the count."""
    from embedserve.controller.kube import COUNT_FIELDS

    role = _one("Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    for prefix, _ in COUNT_FIELDS.values():
        parts = prefix.strip("/").split("/")  # apis/<group>/<version>/namespaces/{ns}/<resource>
        group, resource = parts[1], parts[-1]
        assert {(group, resource, "get"), (group, resource, "patch")} <= granted, resource
    assert ("autoscaling", "horizontalpodautoscalers", "list") in granted


def test_controller_settings_parse_and_fit_the_startup_budget(monkeypatch):
    from embedserve.config import Settings

    ctr = _controller()["spec"]["template"]["spec"]["containers"][0]
    for k, v in _env(ctr).items():
        monkeypatch.setenv(k, v)
    cfg = Settings(_env_file=None).controller
    # a surge pod is given at least the time the kubelet gives a start, plus scheduling
    sp = _containers()["engine"]["startupProbe"]
    assert cfg.surge_timeout_s > sp["periodSeconds"] * sp["failureThreshold"]
    port = next(p["containerPort"] for p in ctr["ports"] if p["name"] == "metrics")
    assert cfg.metrics_port == port
    monitors = [d for _, d in _resources() if d["kind"] == "PodMonitor"]
    scraped = [m for m in monitors if m["spec"]["selector"]["matchLabels"].items()
               <= _controller()["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
    assert [e["port"] for m in scraped for e in m["spec"]["podMetricsEndpoints"]] == ["metrics"]


# ------------------------------------------------------------------ autoscaling components

COMPONENTS = K8S / "components"
ADAPTER_RULES = COMPONENTS / "autoscaling-hpa" / "prometheus-adapter-rules.yaml"
# The keys KEDA's prometheus scaler reads from a trigger's metadata (pkg/scalers/
# prometheus_scaler.go of KEDA v2.20.1): the CRD types metadata as a map of strings.
KEDA_PROMETHEUS_KEYS = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
    "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner",
}  # fmt: skip


def _component(name: str) -> list[dict[str, Any]]:
    folder = COMPONENTS / name
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kust["kind"] == "Component"
    return [d for f in kust["resources"] for d in yaml.safe_load_all((folder / f).read_text()) if d]


def _scaled_object() -> dict[str, Any]:
    (so,) = _component("autoscaling-keda")
    return so


def _hpa() -> dict[str, Any]:
    (hpa,) = _component("autoscaling-hpa")
    return hpa


def _target_load() -> float:
    return float(_one("ConfigMap")["data"]["EMBEDSERVE_CONTROLLER__TARGET_LOAD"])


def _quantity(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_components_list_their_manifests():
    for folder in COMPONENTS.iterdir():
        kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
        on_disk = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml", ADAPTER_RULES.name}
        listed = set(kust.get("resources", [])) | {p["path"] for p in kust.get("patches", []) if "path" in p}
        assert listed == on_disk, folder.name
    assert {p.name for p in COMPONENTS.iterdir()} == {"autoscaling-keda", "autoscaling-hpa", "rerank-one-gpu"}


def _patched_server(component: str) -> dict[str, Any]:
    """The Deployment with a component's strategic-merge patch applied as kustomize merges it
    (containers by name, their env by name)."""
    server = json.loads(json.dumps(_server()))
    folder = COMPONENTS / component
    for ref in yaml.safe_load((folder / "kustomization.yaml").read_text())["patches"]:
        patch = yaml.safe_load((folder / ref["path"]).read_text())
        containers = {c["name"]: c for c in server["spec"]["template"]["spec"]["containers"]}
        for c in patch["spec"]["template"]["spec"]["containers"]:
            if c["name"] not in containers:
                server["spec"]["template"]["spec"]["containers"].append(c)
                continue
            env = {e["name"]: e for e in containers[c["name"]].get("env", [])}
            env.update({e["name"]: e for e in c.get("env", [])})
            containers[c["name"]]["env"] = list(env.values())
    return server


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_reranker_component_serves_two_models_from_one_pod(version, monkeypatch):
    """Its Deployment validates; the gateway's models reach the two engine containers' ports, and
    each engine serves the folder the gateway names for it."""
    kv = pytest.importorskip("kubernetes_validate")
    server = _patched_server("rerank-one-gpu")
    kv.validate(server, version, strict=True)
    containers = {c["name"]: c for c in server["spec"]["template"]["spec"]["containers"]}
    gateway = {e["name"]: e.get("value") for e in containers["gateway"]["env"]}
    for k in [k for k in os.environ if k.startswith("EMBEDSERVE_")]:
        monkeypatch.delenv(k)
    settings = Settings(_env_file=None, served={"models": json.loads(gateway["EMBEDSERVE_SERVED__MODELS"])})
    engines = {}
    for name in ("engine", "reranker"):
        c = containers[name]
        env = _env(c)
        (port,) = [p["containerPort"] for p in c["ports"]]
        assert int(env["EMBEDSERVE_ENGINE__PORT"]) == port == c["startupProbe"]["httpGet"]["port"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        engines[f"http://127.0.0.1:{port}"] = env["EMBEDSERVE_MODEL__PATH"]
    served = {url: m.path for m in settings.served.models for url in m.engine["urls"]}
    assert served == engines
    assert [m.kind for m in settings.served.models] == ["embed", "rerank"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_hpa_validates_strictly(version):
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(_hpa(), version, strict=True)


def test_scaled_object_validates_against_the_keda_crd():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((K8S / "schemas" / "scaledobject-keda-v1alpha1.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    so = _scaled_object()
    jsonschema.validate(so, schema)
    spec = so["spec"]
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]  # the CRD's CEL rule
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) <= KEDA_PROMETHEUS_KEYS
        assert all(isinstance(v, str) for v in trigger["metadata"].values())
    bad = json.loads(json.dumps(so))
    behavior = bad["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    behavior["scaleUp"]["stabilisationWindowSeconds"] = 60  # a British spelling: no such field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_adapter_rule_validates_against_the_adapters_config():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((K8S / "schemas" / "prometheus-adapter-config.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    rules = yaml.safe_load(ADAPTER_RULES.read_text())
    jsonschema.validate(rules, schema)
    bad = json.loads(json.dumps(rules))
    bad["rules"][0]["metricQuery"] = bad["rules"][0].pop("metricsQuery")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_autoscalers_query_metrics_the_gateway_exports(monkeypatch):
    from tests.test_deploy_images import _exported_names

    exported = _exported_names(monkeypatch)
    (rule,) = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    queries = [rule["seriesQuery"], *(t["metadata"]["query"] for t in _scaled_object()["spec"]["triggers"])]
    used = {m for q in queries for m in re.findall(r"embedserve_\w+", q)}
    assert used and used <= exported, sorted(used - exported)
    assert re.fullmatch(rule["name"]["matches"], "embedserve_load")
    # the HPA asks the adapter for the name the rule serves the series under
    (metric,) = _hpa()["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_autoscalers_aim_at_the_configured_target_load():
    target = _target_load()
    (trigger,) = _scaled_object()["spec"]["triggers"]
    assert float(trigger["metadata"]["threshold"]) == target
    assert trigger["metricType"] == "AverageValue"  # replicas = ceil(sum(load) / threshold)
    assert "sum(" in trigger["metadata"]["query"]
    (metric,) = _hpa()["spec"]["metrics"]
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert _quantity(metric["pods"]["target"]["averageValue"]) == target


def _behaviors() -> dict[str, dict[str, Any]]:
    so = _scaled_object()["spec"]
    return {
        "keda": {"min": so["minReplicaCount"], "max": so["maxReplicaCount"],
                 **so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
        "hpa": {"min": _hpa()["spec"]["minReplicas"], "max": _hpa()["spec"]["maxReplicas"],
                **_hpa()["spec"]["behavior"]},
    }  # fmt: skip


@pytest.mark.parametrize("which", ["keda", "hpa"])
def test_scaling_behaviour_fits_minutes_long_cold_starts(which):
    b = _behaviors()[which]
    up, down = b["scaleUp"], b["scaleDown"]
    # at most one pod added per cold start: every policy adds one pod per period >= a start
    assert up["selectPolicy"] != "Disabled" and up["policies"]
    for policy in up["policies"]:
        assert policy["type"] == "Pods" and policy["value"] == 1
        assert policy["periodSeconds"] >= COLD_JIT_START_S
    assert up["stabilizationWindowSeconds"] > 0
    # a pod that took minutes to start is not given back for a lull shorter than two starts
    assert down["stabilizationWindowSeconds"] >= 2 * COLD_JIT_START_S
    for policy in down["policies"]:
        assert policy["type"] == "Pods" and policy["value"] == 1
    # never below the PDB: a voluntary disruption still leaves a pod serving
    assert b["min"] >= _one("PodDisruptionBudget")["spec"]["maxUnavailable"] + 1
    assert b["max"] > b["min"]
    assert _behaviors()["keda"] == _behaviors()["hpa"]  # the two ways behave alike


def test_components_build_and_leave_replicas_to_the_autoscaler(tmp_path):
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed")
    for name, kind in (("autoscaling-keda", "ScaledObject"), ("autoscaling-hpa", "HorizontalPodAutoscaler")):
        overlay = tmp_path / name
        overlay.mkdir()
        base = os.path.relpath(K8S, overlay)
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump({"resources": [base], "components": [f"{base}/components/{name}"]})
        )
        r = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0 and "unknown command" in r.stderr:
            pytest.skip("this kubectl has no kustomize")
        assert r.returncode == 0, r.stderr
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        server = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "embedserve")
        assert "replicas" not in server["spec"], name
        (scaler,) = [d for d in docs if d["kind"] == kind]
        assert scaler["metadata"]["namespace"] == "embedserve"
        assert scaler["spec"]["scaleTargetRef"]["name"] == server["metadata"]["name"]


# ------------------------------------------------------------------ alerts


def test_prometheusrule_is_generated_from_alerts_yaml():
    gen = _gen_module()
    assert gen.main(["--check"]) == 0, "run: python deploy/k8s/gen_prometheusrule.py"
    alerts = ROOT / "deploy" / "prometheus" / "alerts.yaml"
    if alerts.exists():
        shared = yaml.safe_load(alerts.read_text())["groups"]
        rule_groups = _one("PrometheusRule")["spec"]["groups"]
        assert rule_groups[: len(shared)] == shared  # reused as is, not copied by hand


def _hours_thresholds(groups: list[dict[str, Any]]) -> set[float]:
    found = set()
    for g in groups:
        for r in g.get("rules", []):
            expr = str(r.get("expr", ""))
            if "alert" in r and "embedserve_hours_until_oom" in expr:
                m = re.search(r"<=?\s*([0-9.]+)\s*$", expr.strip())
                assert m, f"cannot read the threshold of {r['alert']}: {expr}"
                found.add(float(m.group(1)))
    return found


def test_hours_alerts_agree_with_the_probe_horizons():
    cm = _one("ConfigMap")["data"]
    warning = float(cm["EMBEDSERVE_HEALTH__WARNING_HOURS"])
    critical = float(cm["EMBEDSERVE_HEALTH__CRITICAL_HOURS"])
    got = _hours_thresholds(_one("PrometheusRule")["spec"]["groups"])
    assert got == {warning, critical}


def test_own_alert_group_follows_the_configmap(monkeypatch):
    gen = _gen_module()
    group = gen.probe_group(9.0, 2.5)
    assert _hours_thresholds([group]) == {9.0, 2.5}
    monkeypatch.setattr(gen, "shared_groups", lambda: [])
    groups = gen.build()["spec"]["groups"]
    assert [g["name"] for g in groups] == ["embedserve-probe-horizons"]


def test_alert_rules_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        tool_missing("promtool (Debian package: prometheus)")
    out = tmp_path / "rules.yaml"
    out.write_text(yaml.safe_dump({"groups": _one("PrometheusRule")["spec"]["groups"]}))
    r = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
