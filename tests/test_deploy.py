"""deploy/k8s: the fleet's manifests parse, validate against their schemas and agree with one
another and with Sluice's config, and a live /metrics carries every series the endpoint
picker's configuration names, with the labels and value ranges the model-server protocol
states.

Validation, by kind:
- built-in kinds (Deployment, Service, ConfigMap, RBAC, Namespace): the Kubernetes OpenAPI
  schemas that `kubernetes-validate` ships (offline, strict: unknown fields are errors), for
  the oldest and newest Kubernetes versions checked;
- InferencePool (inference.networking.k8s.io/v1), Gateway and HTTPRoute
  (gateway.networking.k8s.io/v1): CRDs, not in those schemas. Below are JSON Schemas of the
  fields these manifests use, transcribed from the v1 CRDs (types, required fields, enums,
  bounds, patterns; unknown fields rejected), plus the InferencePool CRD's two CEL rules;
- the picker's EndpointPickerConfig is no Kubernetes object: its structure (plugins, the
  profiles' references) is checked, and what it names is read from a live server.

(About 520 lines: the transcribed CRD schemas are half of it, kept beside the checks that
use them.)
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import jsonschema
import msgspec
import pytest
import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from config.settings import Settings

from tests.app.harness import MODEL, serve, settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
KUBERNETES_VERSIONS = ("1.29.0", "latest")  # the oldest supported, and the newest shipped


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def base_objects() -> list[dict]:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [d for name in kust["resources"] for d in load(BASE / name)]


def find(kind: str, name: str, objects: list[dict] | None = None) -> dict:
    found = [o for o in (objects or base_objects())
             if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def gpu_objects() -> list[dict]:
    """The GPU overlay rendered the way kustomize renders it: its strategic-merge patch
    (lists of named items merged by name) and its image tag over the base."""
    kust = yaml.safe_load((K8S / "gpu" / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../base"]
    objects = copy.deepcopy(base_objects())
    for p in kust["patches"]:
        patch = yaml.safe_load((K8S / "gpu" / p["path"]).read_text())
        target = find(p["target"]["kind"], p["target"]["name"], objects)
        assert patch["kind"] == target["kind"] and patch["metadata"]["name"] == \
            target["metadata"]["name"]
        _merge(target, patch)
    for image in kust["images"]:
        used = [c for o in objects if o["kind"] == "Deployment"
                for c in o["spec"]["template"]["spec"]["containers"]
                if c["image"].split(":")[0] == image["name"]]
        assert used, f"the overlay retags {image['name']!r}, which no container runs"
        for c in used:
            c["image"] = f"{image['name']}:{image['newTag']}"
    return objects


def _merge(into: dict, patch: dict) -> None:
    for key, value in patch.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            _merge(old, value)
        elif (isinstance(value, list) and isinstance(old, list)
              and all(isinstance(v, dict) and "name" in v for v in value + old)):
            by_name = {v["name"]: v for v in old}
            for v in value:
                assert v["name"] in by_name, f"patch adds an unknown {key} item {v['name']!r}"
                _merge(by_name[v["name"]], v)
        else:
            into[key] = copy.deepcopy(value)


# --- the files ----------------------------------------------------------------------------


def test_every_manifest_parses_and_kustomize_lists_them_all():
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    files = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files, "a manifest kustomize would not apply"
    assert kust["namespace"] == "sluice"
    kinds = set()
    for obj in base_objects():
        assert set(obj) >= {"apiVersion", "kind", "metadata"}, obj
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
        assert "namespace" not in obj["metadata"], "kustomize sets the namespace"
        kinds.add(obj["kind"])
    assert kinds >= {"Deployment", "Service", "ConfigMap", "InferencePool", "Gateway",
                     "HTTPRoute", "ServiceAccount", "Role", "RoleBinding"}
    assert (ROOT / "deploy" / "Containerfile").is_file()


# --- Kubernetes schemas -------------------------------------------------------------------


def _k8s_validate(obj: dict, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    version = kv.utils.latest_version() if version == "latest" else version
    kv.validate(obj, version, strict=True)


BUILTIN = re.compile(r"^(v1|apps/v1|rbac\.authorization\.k8s\.io/v1)$")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_builtin_kinds_validate_against_the_kubernetes_schemas(version, overlay):
    objects = base_objects() if overlay == "base" else gpu_objects()
    checked = 0
    for obj in objects:
        if BUILTIN.match(obj["apiVersion"]):
            _k8s_validate(obj, version)
            checked += 1
    assert checked >= 10


def test_the_kubernetes_schemas_catch_mistakes():
    """The validator bites: a misspelt field and a wrongly typed one are refused."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[dev]'")
    dep = find("Deployment", "sluice")
    typo = copy.deepcopy(dep)
    c = typo["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "three"
    for bad in (typo, wrong_type):
        with pytest.raises(kv.utils.ValidationError):
            _k8s_validate(bad, "latest")


# --- CRD schemas (transcribed from the v1 CRDs) -------------------------------------------

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_GROUP = r"^$|" + _DNS_SUBDOMAIN
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_META = {"type": "object", "required": ["name"],
         "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}}


def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "required": required, "properties": props,
            "additionalProperties": False}


INFERENCE_POOL_V1 = _obj(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "inference.networking.k8s.io/v1"},
    kind={"const": "InferencePool"},
    metadata=_META,
    spec=_obj(
        ["endpointPickerRef", "selector", "targetPorts"],
        selector=_obj(["matchLabels"], matchLabels={
            "type": "object", "minProperties": 1, "maxProperties": 64,
            "additionalProperties": {"type": "string", "maxLength": 63,
                                     "pattern": _LABEL_VALUE}}),
        targetPorts={"type": "array", "minItems": 1, "maxItems": 8,
                     "items": _obj(["number"], number=_PORT)},
        endpointPickerRef=_obj(
            ["name"],
            group={"type": "string", "maxLength": 253, "pattern": _GROUP},
            kind={"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
            name={"type": "string", "minLength": 1, "maxLength": 253},
            port=_obj(["number"], number=_PORT),
            failureMode={"enum": ["FailOpen", "FailClose"]}),
    ),
)

_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_SECTION = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_REF = dict(group={"type": "string", "maxLength": 253, "pattern": _GROUP},
            kind={"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
            name={"type": "string", "minLength": 1, "maxLength": 253},
            namespace={"type": "string", "minLength": 1, "maxLength": 63})

GATEWAY_V1 = _obj(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "gateway.networking.k8s.io/v1"}, kind={"const": "Gateway"},
    metadata=_META,
    spec=_obj(["gatewayClassName", "listeners"],
              gatewayClassName={"type": "string", "minLength": 1, "maxLength": 253},
              listeners={"type": "array", "minItems": 1, "maxItems": 64, "items": _obj(
                  ["name", "port", "protocol"],
                  name={"type": "string", "maxLength": 253, "pattern": _SECTION},
                  port=_PORT,
                  protocol={"type": "string", "minLength": 1, "maxLength": 255,
                            "pattern": r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|"
                                       r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]"
                                       r"([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9]+$"},
                  hostname={"type": "string"},
                  allowedRoutes=_obj([], namespaces=_obj(
                      [], **{"from": {"enum": ["All", "Selector", "Same"]}})))}),
)

HTTP_ROUTE_V1 = _obj(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "gateway.networking.k8s.io/v1"}, kind={"const": "HTTPRoute"},
    metadata=_META,
    spec=_obj(["parentRefs", "rules"],
              parentRefs={"type": "array", "maxItems": 32, "items": _obj(
                  ["name"], sectionName={"type": "string", "pattern": _SECTION},
                  port=_PORT, **_REF)},
              rules={"type": "array", "minItems": 1, "maxItems": 16, "items": _obj(
                  [],
                  matches={"type": "array", "maxItems": 64, "items": _obj([], path=_obj(
                      ["type", "value"],
                      type={"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                      value={"type": "string", "maxLength": 1024, "pattern": "^/"}))},
                  backendRefs={"type": "array", "maxItems": 16, "items": _obj(
                      ["name"], port=_PORT,
                      weight={"type": "integer", "minimum": 0, "maximum": 1000000},
                      **_REF)},
                  timeouts=_obj([], request=_DURATION, backendRequest=_DURATION))}),
)

CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
               ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY_V1,
               ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_V1}


def validate_crd(obj: dict) -> None:
    jsonschema.Draft202012Validator(CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]).validate(obj)
    if obj["kind"] == "InferencePool":  # the CRD's CEL rules
        ref = obj["spec"]["endpointPickerRef"]
        if ref.get("kind", "Service") == "Service":
            assert "port" in ref, "port is required when kind is 'Service' or unspecified"
        numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
        assert len(set(numbers)) == len(numbers), "port number must be unique"


def test_every_custom_resource_validates_against_its_v1_schema():
    custom = [o for o in base_objects() if not BUILTIN.match(o["apiVersion"])]
    assert {(o["apiVersion"], o["kind"]) for o in custom} == set(CRD_SCHEMAS)
    for obj in custom:
        validate_crd(obj)


def test_the_inference_pool_schema_refuses_the_pre_ga_shape():
    """v1alpha2's fields (targetPortNumber, extensionRef) are not v1's; a Service reference
    without its port breaks the CRD's rule."""
    pool = find("InferencePool", "sluice")
    old = copy.deepcopy(pool)
    old["spec"]["targetPortNumber"] = old["spec"].pop("targetPorts")[0]["number"]
    old["spec"]["extensionRef"] = old["spec"].pop("endpointPickerRef")
    no_port = copy.deepcopy(pool)
    del no_port["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(old)
    with pytest.raises(AssertionError, match="port is required"):
        validate_crd(no_port)


# --- the manifests agree ------------------------------------------------------------------


def sluice_settings() -> Settings:
    toml = find("ConfigMap", "sluice-config")["data"]["sluice.toml"]
    return msgspec.toml.decode(toml.encode(), type=Settings)  # as `sluice serve --config`


def epp_config() -> dict:
    return yaml.safe_load(find("ConfigMap", "sluice-epp-config")["data"]["epp.yaml"])


def plugin(cfg: dict, type_: str) -> dict:
    found = [p for p in cfg["plugins"] if p["type"] == type_]
    assert len(found) == 1, type_
    return found[0]


def engine_specs() -> dict[str, str]:
    """The metric specs the picker reads Sluice's pods with: {field: spec}."""
    params = plugin(epp_config(), "core-metrics-extractor")["parameters"]
    engine = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    assert len(engine) == 1
    return {k: v for k, v in engine[0].items() if k.endswith("Spec")}


SPEC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?$")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A picker metric spec, `name` or `name{label="value",...}`, as the picker parses it."""
    m = SPEC.match(spec.strip())
    assert m, spec
    labels = dict(re.findall(r'(\w+)\s*=\s*"?([^",}]*)"?', m.group(2) or ""))
    return m.group(1), labels


def args_of(container: dict) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in container["args"])


def test_the_epp_config_is_well_formed():
    cfg = epp_config()
    assert cfg["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert cfg["kind"] == "EndpointPickerConfig"
    names = [p.get("name", p["type"]) for p in cfg["plugins"]]
    assert len(set(names)) == len(names)
    for profile in cfg["schedulingProfiles"]:
        for ref in profile["plugins"]:
            assert ref["pluginRef"] in names, ref
            assert ref.get("weight", 1) > 0
    specs = engine_specs()
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                          "loraSpec", "cacheInfoSpec"}, "the protocol's five signals"
    metrics = plugin(cfg, "metrics-data-source")["parameters"]
    assert (metrics["scheme"], metrics["path"]) == ("http", "/metrics")


def test_the_manifests_agree_with_each_other_and_with_sluice():
    cfg = sluice_settings()  # decodes as Sluice's own Settings: every key is known
    pool_cfg, = cfg.pools
    dep = find("Deployment", "sluice")
    pod = dep["spec"]["template"]
    c, = pod["spec"]["containers"]
    pool = find("InferencePool", "sluice")

    # Sluice listens where the pool and the Service send requests.
    assert cfg.server.host == "0.0.0.0"
    port, = [p for p in c["ports"] if p["name"] == "http"]
    assert port["containerPort"] == cfg.server.port == pool["spec"]["targetPorts"][0]["number"]
    assert c["args"] == ["serve", "--config", "/etc/sluice/sluice.toml"]
    mount, = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert mount["mountPath"] == "/etc/sluice"
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    svc = find("Service", "sluice")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    # Probes: /health for all three; drain fits in the grace period.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # cold start + compile
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + cfg.server.drain_grace_s + 5
    assert not cfg.batches.enabled  # per-pod stores behind a load balancer
    assert pool_cfg.replicas == 1 and pool_cfg.scheduler.prefix_cache

    # The picker reads this pool's series, for pods of this engine type.
    epp = epp_config()
    params = plugin(epp, "core-metrics-extractor")["parameters"]
    assert pod["metadata"]["labels"][params["engineLabelKey"]] == params["defaultEngine"]
    for field, spec in engine_specs().items():
        name, labels = parse_spec(spec)
        assert name.startswith("sluice:"), field
        assert labels == {"pool": pool_cfg.name}, field
    prefix = plugin(epp, "prefix-cache-scorer")["parameters"]
    assert prefix["blockSizeTokens"] == pool_cfg.page_size
    assert prefix["maxPrefixBlocksToMatch"] * pool_cfg.page_size >= 2000  # a system prompt

    # The pool points at the picker's Service; the picker serves that pool.
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = find("Service", ref["name"])
    grpc, = [p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp_dep = find("Deployment", "sluice-epp")
    epp_pod = epp_dep["spec"]["template"]
    e, = epp_pod["spec"]["containers"]
    assert grpc["targetPort"] in {p["name"] for p in e["ports"]}
    assert epp_svc["spec"]["selector"].items() <= epp_pod["metadata"]["labels"].items()
    args = args_of(e)
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == "inference.networking.k8s.io"
    assert int(args["grpc-port"]) == next(p["containerPort"] for p in e["ports"]
                                          if p["name"] == grpc["targetPort"])
    config_dir, config_file = args["config-file"].rsplit("/", 1)
    vm, = [m for m in e["volumeMounts"] if m["mountPath"] == config_dir]
    vol, = [v for v in epp_pod["spec"]["volumes"] if v["name"] == vm["name"]]
    assert config_file in find("ConfigMap", vol["configMap"]["name"])["data"]
    assert epp_pod["spec"]["terminationGracePeriodSeconds"] >= \
        pod["spec"]["terminationGracePeriodSeconds"]

    # RBAC names the picker's service account, in the namespace kustomize applies.
    sa = epp_pod["spec"]["serviceAccountName"]
    find("ServiceAccount", sa)
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for b in [o for o in base_objects() if o["kind"] == kind]:
            s, = b["subjects"]
            assert s["name"] == sa
            assert s.get("namespace", kust["namespace"]) == kust["namespace"]
            find(b["roleRef"]["kind"], b["roleRef"]["name"])
    role = find("Role", "sluice-epp")
    watched = {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= watched

    # The route sends the API to the pool through the Gateway.
    route = find("HTTPRoute", "sluice")
    parent, = route["spec"]["parentRefs"]
    find("Gateway", parent["name"])
    backend, = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])


def test_the_gpu_overlay_asks_for_one_gpu_per_pod():
    dep = find("Deployment", "sluice", gpu_objects())
    c, = dep["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].endswith("-cuda")
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # the patch kept the rest


# --- what the picker reads, from a live server ---------------------------------------------


def series(text: str, spec: str) -> tuple[str, list]:
    """The family `spec` names and its samples whose labels match the spec's selector."""
    name, want = parse_spec(spec)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert name in families, f"/metrics has no {name}"
    family = families[name]
    return family.type, [s for s in family.samples
                         if s.name == name and want.items() <= s.labels.items()]


def deploy_pool_settings(max_loras: int) -> Settings:
    """The test harness's server with the manifests' pool name (the specs select on it)."""
    cfg = settings()
    pool = msgspec.structs.replace(cfg.pools[0], name=sluice_settings().pools[0].name,
                                   max_loras=max_loras)
    return msgspec.structs.replace(cfg, pools=[pool])


@pytest.mark.parametrize("max_loras", [1, 0])
async def test_metrics_carry_every_series_the_picker_is_configured_with(max_loras):
    specs = engine_specs()
    async with serve(deploy_pool_settings(max_loras), step_delay_s=0.02) as srv, \
            srv.client() as http:
        runner = srv.pool.engines[0].runner

        async def scrape() -> str:
            r = await http.get("/metrics")
            assert r.status_code == 200
            return r.text

        def value(text: str, field: str) -> float:
            kind, samples = series(text, specs[field])
            assert kind == "gauge" and len(samples) == 1, (field, kind, samples)
            return samples[0].value

        idle = await scrape()
        assert value(idle, "queuedRequestsSpec") == value(idle, "runningRequestsSpec") == 0
        assert value(idle, "kvUsageSpec") == 0

        # Load: more streams than may run at once, so some run and some wait.
        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(lambda: http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "abcdefgh" * 4, "max_tokens": 30}))
            with trio.fail_after(10):
                while True:
                    busy = await scrape()
                    if value(busy, "runningRequestsSpec") >= 1 and \
                            value(busy, "queuedRequestsSpec") >= 1:
                        break
                    await trio.sleep(0.02)

        # Gauges of requests: whole numbers >= 0; KV usage: a fraction, of the pages in use.
        for field in ("queuedRequestsSpec", "runningRequestsSpec"):
            v = value(busy, field)
            assert v >= 0 and v == int(v), (field, v)
        usage = value(busy, "kvUsageSpec")
        assert 0 < usage <= 1
        pool = parse_spec(specs["kvUsageSpec"])[1]["pool"]
        labels = f'{{model="{MODEL}",pool="{pool}"}}'
        pages = {m: float(re.search(rf"^sluice:{m}{re.escape(labels)} (\S+)$", busy, re.M)[1])
                 for m in ("kv_pages_in_use", "kv_pages_total")}
        assert usage == pytest.approx(pages["kv_pages_in_use"] / pages["kv_pages_total"])

        # Cache geometry: value 1; block_size = the KV page size in tokens, num_gpu_blocks =
        # the pool's pages, both integers as the picker parses them.
        kind, (info,) = series(busy, specs["cacheInfoSpec"])
        assert kind == "gauge" and info.value == 1
        assert int(info.labels["block_size"]) == runner.page_size
        assert int(info.labels["num_gpu_blocks"]) == pages["kv_pages_total"] > 0

        # LoRA: value = a timestamp (the picker keeps the latest series), adapters as
        # comma-separated names, max_lora = the slots. Absent without slots, as in vLLM.
        if max_loras:
            kind, (lora,) = series(busy, specs["loraSpec"])
            assert kind == "gauge" and abs(lora.value - time.time()) < 60
            assert set(lora.labels) >= {"running_lora_adapters", "waiting_lora_adapters",
                                        "max_lora"}
            assert int(lora.labels["max_lora"]) == max_loras
            assert lora.labels["running_lora_adapters"] == ""  # base-model requests only
        else:  # declared without samples: a parser drops the empty family
            assert series(busy, specs["loraSpec"])[1] == []

        await srv.wait_idle()
        idle = await scrape()
        assert value(idle, "runningRequestsSpec") == value(idle, "queuedRequestsSpec") == 0
        assert value(idle, "kvUsageSpec") == 0
