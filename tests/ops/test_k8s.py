"""k8s/: every overlay renders, validates against KubeRay's CRD schema, embeds a sound Serve
config generated from deploy/, and has the shape the operator and Serve rely on."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tests.ops.serve_config import all_problems, deployment_infos, load
from tests.ops.strict_schema import unknown_fields

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The KubeRay CRDs: $SLIMSERVE_KUBERAY_CRDS, else the project's shared/ folder beside the repo.
KUBERAY = os.environ.get(
    "SLIMSERVE_KUBERAY_CRDS", os.path.join(os.path.dirname(ROOT), "shared", "kuberay")
)
TARGETS = ["k8s/base", "k8s/overlays/dev", "k8s/overlays/prod"]
GPU_TARGETS = ["k8s/base", "k8s/overlays/prod"]
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
UPGRADE_TYPES = {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


def _load_render():
    spec = importlib.util.spec_from_file_location("k8s_render", os.path.join(ROOT, "k8s/render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    if not os.path.isdir(KUBERAY):
        why = (
            f"KubeRay CRD schemas not found at {KUBERAY}: set SLIMSERVE_KUBERAY_CRDS to a folder "
            f"holding {' and '.join(CRD_FILES.values())} (CI has them in <repo>/../shared/kuberay)"
        )
        if os.environ.get("SLIMSERVE_REQUIRE_CRDS"):  # .ci/run: a missing schema is a failure
            pytest.fail(why)
        pytest.skip(why)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are ~1 MB each
    schemas = {}
    for kind, name in CRD_FILES.items():
        with open(os.path.join(KUBERAY, name)) as f:
            crd = yaml.load(f, Loader=loader)
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schemas[kind] = v1["schema"]["openAPIV3Schema"]
    return schemas


def rendered(target: str) -> list[dict]:
    return render.build(os.path.join(ROOT, target))


def the_service(target: str) -> dict:
    (service,) = [d for d in rendered(target) if d["kind"] == "RayService"]
    return service


def pods(service: dict) -> list[tuple[str, dict, dict]]:
    """(group name, group spec, pod spec) for the head and every worker group."""
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    out = [("head", head, head["template"]["spec"])]
    out += [(g["groupName"], g, g["template"]["spec"]) for g in cluster["workerGroupSpecs"]]
    return out


def quantity(value: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, scale in units.items():
        if str(value).endswith(suffix):
            return int(float(value[: -len(suffix)]) * scale)
    return int(value)


@pytest.mark.parametrize("target", TARGETS)
def test_manifests_validate_against_the_crd_schema(target, crd_schemas):
    docs = [d for d in rendered(target) if d["apiVersion"] == "ray.io/v1"]
    assert [d["kind"] for d in docs] == ["RayService"], target
    for doc in docs:
        jsonschema.validate(doc, crd_schemas[doc["kind"]])
        assert unknown_fields(doc, crd_schemas[doc["kind"]]) == [], target


@pytest.mark.parametrize(
    "where, field, path",
    [
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0), "maxReplicaz", "maxReplicaz"),
        (("spec",), "serveConfigV2Typo", "/spec/serveConfigV2Typo"),
        (("metadata",), "labelz", "/metadata/labelz"),
        (
            ("spec", "rayClusterConfig", "headGroupSpec", "template", "spec"),
            "containerz",
            "/template/spec/containerz",
        ),
    ],
)
def test_strict_validation_rejects_unknown_fields(crd_schemas, where, field, path):
    """Seen failing: plain jsonschema.validate accepted each of these documents."""
    service = the_service("k8s/base")
    node = service
    for step in where:
        node = node[step]
    node[field] = 8
    jsonschema.validate(service, crd_schemas["RayService"])  # what the old test relied on
    bad = unknown_fields(service, crd_schemas["RayService"])
    assert len(bad) == 1 and bad[0].endswith(path), bad


def test_strict_validation_keeps_maps_and_preserved_fields(crd_schemas):
    """Labels, resource maps and int-or-string values are declared, not unknown."""
    service = the_service("k8s/base")
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    head["template"]["metadata"].setdefault("labels", {})["any-label"] = "x"
    head["rayStartParams"]["any-param"] = "1"
    assert unknown_fields(service, crd_schemas["RayService"]) == []


@pytest.mark.parametrize("target", TARGETS)
def test_grpc_service_reaches_every_serving_pod(target):
    (svc,) = [d for d in rendered(target) if d["kind"] == "Service"]
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(9000, "serve-grpc")]
    assert svc["metadata"]["name"] == "slimserve-grpc"
    selector = dict(svc["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"  # the label KubeRay keeps on ready pods
    for name, _, pod in pods(the_service(target)):
        template = _template(the_service(target), name)
        assert selector.items() <= template["metadata"]["labels"].items(), name
        ports = {p["name"] for p in pod["containers"][0]["ports"]}
        assert "serve-grpc" in ports, name


def _template(service: dict, group: str) -> dict:
    cluster = service["spec"]["rayClusterConfig"]
    if group == "head":
        return cluster["headGroupSpec"]["template"]
    return next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == group)["template"]


def test_schema_check_catches_a_bad_manifest(crd_schemas):
    service = the_service("k8s/base")
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, crd_schemas["RayService"])


@pytest.mark.parametrize("target", TARGETS)
def test_embedded_serve_config_is_sound(target):
    config = yaml.safe_load(the_service(target)["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    assert all_problems(config) == []


def test_serve_configs_are_generated_from_deploy():
    assert render.main(["check"]) == 0, "run: python k8s/render.py sync"
    base = yaml.safe_load(the_service("k8s/base")["spec"]["serveConfigV2"])
    gpu = load(os.path.join(ROOT, "deploy/gpu.yaml"))
    assert base == render.pin_to_worker_groups(gpu)
    for app in base["applications"]:  # the pins are the only difference
        for dep in app["deployments"]:
            dep["ray_actor_options"].pop("label_selector", None)
    assert base == gpu
    dev = yaml.safe_load(the_service("k8s/overlays/dev")["spec"]["serveConfigV2"])
    local = load(os.path.join(ROOT, "deploy/local.yaml"))
    assert dev == {**local, "http_options": {**local["http_options"], "host": "0.0.0.0"}}


@pytest.mark.parametrize("target", TARGETS)
def test_cluster_shape(target):
    service = the_service(target)
    spec, cluster = service["spec"], service["spec"]["rayClusterConfig"]
    assert len(service["metadata"]["name"]) <= 47  # KubeRay's limit for RayService names
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES
    assert cluster["enableInTreeAutoscaling"] is True
    groups = [g["groupName"] for g in cluster["workerGroupSpecs"]]
    assert groups == ["prefill-gpu", "decode-gpu"]  # the overlays' JSON patches index these
    for name, group, pod in pods(service):
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == 8000 and ports["serve-grpc"] == 9000, name
        assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"]), name
        res = container["resources"]
        assert res["requests"]["cpu"] and res["limits"]["memory"], name
        assert "exec" in container["readinessProbe"] and "exec" in container["livenessProbe"]
        if name != "head":  # KubeRay's RayService readiness: the node's Serve proxy
            assert "localhost:8000/-/healthz" in " ".join(
                container["readinessProbe"]["exec"]["command"]
            )
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm and shm[0]["emptyDir"]["medium"] == "Memory", name
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm", name
        store = group["rayStartParams"].get("object-store-memory")
        if store is not None:
            assert int(store) <= quantity(shm[0]["emptyDir"]["sizeLimit"]), name


@pytest.mark.parametrize("target", TARGETS)
def test_every_ray_container_runs_the_cli_default_proxy(target):
    """Ray reads the proxy switch when each node starts: a head and workers that disagree
    would split the cluster between HAProxy and Serve's proxy. The value is `slimserve
    serve`'s default (docs/serving.md "Proxy")."""
    from app.serve.cli import DEFAULT_PROXY, HAPROXY_ENV, proxy_env

    for name, _, pod in pods(the_service(target)):
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get(HAPROXY_ENV) == proxy_env(DEFAULT_PROXY)[HAPROXY_ENV], name


@pytest.mark.parametrize("target", TARGETS)
def test_gpus_only_where_meant(target):
    for name, _, pod in pods(the_service(target)):
        limits = pod["containers"][0]["resources"]["limits"]
        wants_gpu = target in GPU_TARGETS and name != "head"
        assert ("nvidia.com/gpu" in limits) == wants_gpu, (target, name)


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_worker_groups_match_the_pinned_deployments(target):
    service = the_service(target)
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    app = ServeDeploySchema.model_validate(config).applications[0]
    infos = deployment_infos(app)
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for dep_name, role in render.PINS.items():
        info = infos[dep_name]
        selector = info.replica_config.ray_actor_options["label_selector"]
        (group,) = [g for g in groups if g.get("labels", {}).get(render.ROLE_LABEL) == role]
        assert selector == {render.ROLE_LABEL: role}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits["nvidia.com/gpu"])
        per_replica = info.replica_config.ray_actor_options["num_gpus"]
        auto = info.deployment_config.autoscaling_config
        # The group can grow to hold the deployment's max_replicas (one replica per GPU).
        assert group["maxReplicas"] * gpus >= auto.max_replicas * per_replica, dep_name
        assert group["minReplicas"] * gpus >= auto.min_replicas * per_replica, dep_name


def test_prod_pins_gpu_pools():
    for name, _, pod in pods(the_service("k8s/overlays/prod")):
        assert pod["nodeSelector"], name
        if name != "head":
            assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here")
@pytest.mark.parametrize("target", TARGETS)
def test_render_matches_kubectl_kustomize(target):
    out = subprocess.run(
        ["kubectl", "kustomize", os.path.join(ROOT, target)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # kustomize orders by kind
    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    assert theirs == sorted(rendered(target), key=key)


def test_merge_and_json_patches():
    doc = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert render.merge_patch(doc, {"a": {"c": [3], "e": 2}, "d": None}) == {
        "a": {"b": 1, "c": [3], "e": 2}
    }
    ops = [
        {"op": "add", "path": "/a/c/-", "value": 9},
        {"op": "replace", "path": "/a/b", "value": 5},
        {"op": "remove", "path": "/a/c/0"},
        {"op": "add", "path": "/x~1y", "value": {}},
    ]
    assert render.json_patch(doc, ops) == {"a": {"b": 5, "c": [2, 9]}, "d": 1, "x/y": {}}
    with pytest.raises(ValueError):
        render.json_patch(doc, [{"op": "replace", "path": "/missing", "value": 1}])


def test_unsupported_kustomization_fields_fail(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages: [{name: x}]\n")
    with pytest.raises(ValueError, match="images"):
        render.build(str(tmp_path))


def test_render_cli_builds(capsys):
    assert render.main(["build", os.path.join(ROOT, "k8s/overlays/prod")]) == 0
    assert "kind: RayService" in capsys.readouterr().out
