"""A kubelet, as far as our tests need one: start the pod the Helm chart renders and probe it.

No Kubernetes API server can run here (see /work/shared/TOOLS.md), so this plays the node's part for
one rendered Deployment:
- the pod gets a network namespace of its own and a link-local address on a veth pair (unique
  names per test process, always torn down); its containers' processes run inside it, so what
  listens on 127.0.0.1 there is invisible from outside, as on a real node;
- each volume is a temp dir (emptyDir medium Memory: a tmpfs); ConfigMap and Secret volumes hold
  the objects' keys (written the kubelet's atomic way, so an update swaps `..data`); host mode
  remaps paths: every mount path in a container's args, env values and mounted ConfigMap files becomes
  its temp dir (a text substitution);
- a container's process is its rendered command + args ($(VAR) expanded) with its rendered env
  (value, secretKeyRef, configMapKeyRef, fieldRef, envFrom) on top of the image's ENV, in the
  pod's netns. Host mode (the default): the commands are the
  console scripts of the Python environment running the tests (its bin dir stands in for the
  image's /opt/loraplex/bin on PATH), with PYTHONPATH at this checkout and OMP_NUM_THREADS=1;
- init containers with restartPolicy: Always are native sidecars: started first, their startup
  probe must pass before the next container starts; on termination they stop after the others;
- probes run as the kubelet runs them, from outside the netns against the pod IP: grpc (a
  grpc.health.v1 Check with the probe's service), tcpSocket (a connect), exec (the command in the
  container's context), each with its timeoutSeconds, periodSeconds and thresholds;
- termination: preStop hooks, then SIGTERM, then SIGKILL after terminationGracePeriodSeconds.
Not emulated in that (host) mode: runAsUser/fsGroup (the processes run as the test's user: the Python
running the tests may live where another user cannot read, e.g. under /root), readOnlyRootFilesystem,
capabilities, seccomp, resource limits, image pulls.

Image mode (`Pod(..., image=TAG)`, the image scripts/build_image.sh builds): each container runs in
that image with rootful podman (runc, cgroupfs), as the kubelet would run it: the rendered command
(the image's entrypoint replaced) and args, the rendered env on top of the image's ENV, the securityContext
(runAsUser/runAsGroup, fsGroup as a supplementary group owning the emptyDir, ConfigMap and Secret
volumes with the Secret's defaultMode, runAsNonRoot refused for uid 0, readOnlyRootFilesystem with no
tmpfs added by podman, capabilities dropped/added, no-new-privileges, the runtime's default seccomp
profile), each volume bind-mounted at its mount path (read-only where the mount says so; no path
remapping) and the pod's network namespace (`--network ns:/run/netns/NAME`). Exec probes and preStop
hooks are `podman exec` in the container; signals go through `podman kill`. `root_writes` and
`process_ids` let a test check that nothing was written outside the volumes and nothing ran as root.
Still not emulated: resource limits, image pulls.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.tools import in_ci

REPO = Path(__file__).resolve().parents[1]
HELM = REPO / ".tools" / "bin" / "helm"
CHART_DIR = REPO / "helm" / "loraplex"
VENV_BIN = Path(sys.executable).parent
# The image's ENV (Dockerfile, final stage): PATH gets /opt/loraplex/bin first (here: VENV_BIN).
IMAGE_ENV = {"HOME": "/tmp", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
IMAGE_WORKDIR = "/tmp"
NO_PROXY_GRPC = [("grpc.enable_http_proxy", 0)]
BUILD_IMAGE = REPO / "scripts" / "build_image.sh"
# The sandbox refuses setrlimit (no default ulimits); crun fails on hybrid cgroups (see shared/TOOLS.md).
PODMAN_CONF = REPO / ".tools" / "podman" / "containers.conf"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]


PODMAN_CONF_TEXT = "[containers]\ndefault_ulimits = []\n"


def podman_env() -> dict[str, str]:
    """The environment podman runs in. Its config is replaced whole (a new file renamed over it), never
    rewritten in place: a podman reading a truncated config sets default ulimits, which the sandbox
    refuses (`error setting rlimit type 7`, seen when two test processes used the image at once)."""
    if not PODMAN_CONF.is_file() or PODMAN_CONF.read_text() != PODMAN_CONF_TEXT:
        PODMAN_CONF.parent.mkdir(parents=True, exist_ok=True)
        staged = PODMAN_CONF.with_name(f".{PODMAN_CONF.name}.{os.getpid()}")
        staged.write_text(PODMAN_CONF_TEXT)
        os.replace(staged, PODMAN_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(PODMAN_CONF)}


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, env=podman_env())
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {r.returncode}: {r.stderr[-2000:]}")
    return r


def image_supported() -> str | None:
    """Why image mode cannot run here (None: it can)."""
    if not netns_supported():
        return "needs root and iproute2 for a pod network namespace"
    missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    return f"{', '.join(missing)} not installed (scripts/install_test_tools.sh)" if missing else None


@functools.cache
def build_image(timeout: float = 1800) -> tuple[str, str]:
    """scripts/build_image.sh (cached layers: seconds when nothing changed); (image tag, its summary line).
    Once a test process: the image files share it (even a build with every layer cached takes half a minute)."""
    tag = os.environ.get("LORAPLEX_IMAGE", "localhost/loraplex:cpu")
    r = subprocess.run(["bash", str(BUILD_IMAGE)], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env={**os.environ, "LORAPLEX_IMAGE": tag})
    assert r.returncode == 0, f"scripts/build_image.sh failed:\n{r.stderr[-6000:]}"
    return tag, r.stdout.strip().splitlines()[-1]


def image_under_test(what: str) -> str:
    """The image the tests run: built by scripts/build_image.sh, or LORAPLEX_TEST_IMAGE=TAG (already built).
    Skips where image mode cannot run here; under CI that is a failure (`what` names the tests)."""
    why = image_supported()
    if why:
        if in_ci():
            raise RuntimeError(f"{what} cannot run under CI: {why}")
        pytest.skip(why)
    if os.environ.get("LORAPLEX_TEST_IMAGE"):
        return os.environ["LORAPLEX_TEST_IMAGE"]
    tag, summary = build_image()
    print(summary)
    return tag


def _helm_template(chart: Path, value_files: Sequence[Path], sets: Sequence[str], namespace: str,
                   *extra: str) -> str:
    args = [str(HELM), "template", "rel", str(chart), "--namespace", namespace, *extra]
    for f in value_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render_chart(*value_files: Path, sets: Sequence[str] = (), namespace: str = "ml") -> list[dict]:
    return [d for d in yaml.safe_load_all(_helm_template(CHART_DIR, value_files, sets, namespace)) if d]


def render_notes(*value_files: Path, sets: Sequence[str] = ()) -> str:
    """NOTES.txt as `helm install` prints it (helm template skips it: rendered here through `tpl` in
    a copy of the chart)."""
    with tempfile.TemporaryDirectory(prefix="lpxnotes-") as tmp:
        chart = Path(tmp) / "loraplex"
        shutil.copytree(CHART_DIR, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "NOTES.src")
        (chart / "templates" / "notes-rendered.yaml").write_text(
            'notes: {{ tpl (.Files.Get "NOTES.src") . | toJson }}\n')
        out = _helm_template(chart, value_files, sets, "ml", "--show-only", "templates/notes-rendered.yaml")
        return yaml.safe_load(out)["notes"]


def netns_supported() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


# ---- network -------------------------------------------------------------------------------------
class PodNetwork:
    """`ip netns` + a veth pair with a /30 of 169.254.0.0/16 that no other interface here uses."""

    _count = 0

    def __init__(self) -> None:
        PodNetwork._count += 1
        tag = f"{os.getpid()}{PodNetwork._count}"[-9:]
        self.netns, self.host_if, self.pod_if = f"lpxpod{tag}", f"lpxh{tag}", f"lpxp{tag}"
        taken = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        start = (os.getpid() * 7 + PodNetwork._count * 131) % 16000
        for i in range(16000):
            block = (start + i) % 16000
            a, b = 1 + block // 64, (block % 64) * 4
            self.host_ip, self.pod_ip = f"169.254.{a}.{b + 1}", f"169.254.{a}.{b + 2}"
            if f"inet {self.host_ip}/" not in taken and f"inet {self.pod_ip}/" not in taken:
                break
        self._up = False

    def __enter__(self) -> PodNetwork:
        try:
            for cmd in (
                ["ip", "netns", "add", self.netns],
                ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.pod_if],
                ["ip", "link", "set", self.pod_if, "netns", self.netns],
                ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
                ["ip", "link", "set", self.host_if, "up"],
                ["ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{self.pod_ip}/30", "dev", self.pod_if],
                ["ip", "netns", "exec", self.netns, "ip", "link", "set", self.pod_if, "up"],
                ["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"],
            ):
                subprocess.run(cmd, check=True, capture_output=True, timeout=30)
                self._up = True
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._up:
            return
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
        self._up = False


# ---- the pod -------------------------------------------------------------------------------------
@dataclass
class Container:
    spec: dict
    sidecar: bool  # a native sidecar (init container with restartPolicy: Always)
    paths: dict[str, Path]  # mount path -> host dir
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    podman_name: str = ""  # image mode: the podman container

    @property
    def name(self) -> str:
        return self.spec["name"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command, args and env values ($$ escapes)."""
    parts = text.split("$$")
    return "$".join(_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), p) for p in parts)


def remap(text: str, paths: dict[str, Path]) -> str:
    """Mount paths in `text` (whole path components only) replaced by their host dirs, in one pass."""
    if not paths:
        return text
    alternatives = "|".join(re.escape(m) for m in sorted(paths, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({alternatives})(?=/|$|[^\w.-])", lambda m: str(paths[m.group(1)]), text)


class Pod:
    """The pod of the Deployment in `docs` (helm template output). `cluster`: objects the chart refers
    to without rendering them, {"Secret" | "ConfigMap": {name: {key: value}}}."""

    def __init__(self, docs: list[dict], cluster: dict[str, dict[str, dict[str, str]]], net: PodNetwork,
                 root: Path | None = None, namespace: str = "ml", image: str | None = None) -> None:
        (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
        self.docs, self.net, self.namespace = docs, net, namespace
        self.template = deploy["spec"]["template"]
        self.spec = self.template["spec"]
        self.objects: dict[str, dict[str, dict[str, str]]] = {"Secret": {}, "ConfigMap": {}}
        for kind in ("Secret", "ConfigMap"):
            self.objects[kind].update(cluster.get(kind, {}))
            for d in docs:
                if d["kind"] == kind:
                    data = dict(d.get("data") or {})
                    if kind == "Secret":
                        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
                        data.update(d.get("stringData") or {})
                    self.objects[kind][d["metadata"]["name"]] = data
        self.root = Path(root or tempfile.mkdtemp(prefix="lpxpod-", dir="/tmp"))
        self.name = f"rel-loraplex-{os.getpid()}"
        self.volumes: dict[str, Path] = {}
        self._tmpfs: list[Path] = []
        self.containers: dict[str, Container] = {}
        self.grace_s = float(self.spec.get("terminationGracePeriodSeconds", 30))
        self.sigterm_at: dict[str, float] = {}  # container -> time.monotonic() of its SIGTERM
        self.image = image  # image mode: the containers run in this image with podman
        self.ready_s: float | None = None  # start(): seconds until every container was started and Ready
        self._file_modes: dict[Path, int] = {}  # ConfigMap/Secret volume dir -> its files' mode

    # ---- volumes ----
    def _make_volumes(self) -> None:
        for v in self.spec.get("volumes", []):
            if "hostPath" in v:
                self.volumes[v["name"]] = Path(v["hostPath"]["path"])
                continue
            path = self.root / v["name"]
            path.mkdir(parents=True)
            if "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                size = v["emptyDir"].get("sizeLimit", "64Mi")
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={min(_bytes(size), 512 << 20)}", "tmpfs",
                                str(path)], check=True, capture_output=True, timeout=30)
                self._tmpfs.append(path)
            self.volumes[v["name"]] = path
            if self.image is None:
                continue
            # As the kubelet makes them: an emptyDir is world-writable, and with fsGroup group-owned by
            # it (setgid); ConfigMap/Secret files get defaultMode (0644 unset), group fsGroup.
            fs_group = self.spec.get("securityContext", {}).get("fsGroup")
            if "emptyDir" in v:
                os.chmod(path, 0o2777 if fs_group is not None else 0o777)
            source = v.get("configMap") or v.get("secret")
            if source is not None:
                self._file_modes[path] = int(source.get("defaultMode", 0o644))
            if fs_group is not None:
                os.chown(path, 0, int(fs_group))

    def _fill_volumes(self) -> None:
        """ConfigMap and Secret contents (after the containers' path tables exist, for remapping)."""
        for v in self.spec.get("volumes", []):
            if "configMap" in v or "secret" in v:
                kind, ref = ("ConfigMap", v["configMap"]["name"]) if "configMap" in v else \
                    ("Secret", v["secret"]["secretName"])
                self._write_atomic(self.volumes[v["name"]], self._object(kind, ref))

    def _object(self, kind: str, name: str) -> dict[str, str]:
        assert name in self.objects[kind], f"the pod needs {kind} {name!r}: not rendered, not in the cluster"
        return self.objects[kind][name]

    def _write_atomic(self, path: Path, data: dict[str, str]) -> None:
        """The kubelet's AtomicWriter: files in a fresh `..<ts>` dir, `..data` swapped onto it."""
        stamp = path / f"..{time.time_ns()}"
        stamp.mkdir()
        fs_group = self.spec.get("securityContext", {}).get("fsGroup") if self.image else None
        for key, value in data.items():
            (stamp / key).write_text(self._remap_for_volume(path, value))
            if self.image is not None:
                os.chmod(stamp / key, self._file_modes.get(path, 0o644))
            if fs_group is not None:
                os.chown(stamp / key, 0, int(fs_group))
        tmp = path / "..data_tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(stamp.name)
        old = (path / "..data").resolve() if (path / "..data").exists() else None
        os.replace(tmp, path / "..data")
        for key in data:
            if not (path / key).is_symlink():
                (path / key).symlink_to(f"..data/{key}")
        if old is not None and old != stamp:
            shutil.rmtree(old, ignore_errors=True)

    def _remap_for_volume(self, path: Path, text: str) -> str:
        """ConfigMap content names paths as the containers see them: remap with the first container
        that mounts this volume (before containers exist: no remapping needed yet). Image mode: the
        containers see the real mount paths, nothing to remap."""
        for c in self.containers.values() if self.image is None else ():
            if path in c.paths.values():
                return remap(text, c.paths)
        return text

    def update_config_map(self, name: str, data: dict[str, str]) -> None:
        """`kubectl apply` of a changed ConfigMap, as the kubelet then syncs its volumes."""
        self.objects["ConfigMap"][name] = data
        for v in self.spec.get("volumes", []):
            if v.get("configMap", {}).get("name") == name:
                self._write_atomic(self.volumes[v["name"]], data)

    # ---- containers ----
    def _container(self, spec: dict, sidecar: bool) -> Container:
        paths = {m["mountPath"]: self.volumes[m["name"]] for m in spec.get("volumeMounts", [])}
        c = Container(spec, sidecar, paths, podman_name=f"{self.net.netns}-{spec['name']}")
        # Image mode: the image's own ENV is under the rendered env (podman); HOSTNAME is the pod's name.
        env = dict(IMAGE_ENV) if self.image is None else {}
        env["HOSTNAME"] = self.name
        for src in spec.get("envFrom", []):
            kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
            if ref["name"] in self.objects[kind] or not ref.get("optional"):
                for k, v in self._object(kind, ref["name"]).items():
                    env[src.get("prefix", "") + k] = v
        for e in spec.get("env", []):
            value = self._env_value(e, env)
            if value is not None:
                env[e["name"]] = value
        if self.image is not None:
            c.env = env
            c.argv = [expand(a, env) for a in [*spec.get("command", []), *spec.get("args", [])]]
            return c
        env = {k: remap(v, paths) for k, v in env.items()}
        # Set after the remap: these are host paths (a checkout under /tmp must not be remapped to a volume).
        env["PATH"] = f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        env["PYTHONPATH"] = str(REPO)  # this checkout's code, whatever the venv's editable install points at
        env["OMP_NUM_THREADS"] = "1"
        c.env = env
        c.argv = [remap(expand(a, env), paths) for a in [*spec.get("command", []), *spec.get("args", [])]]
        return c

    def _env_value(self, e: dict, env: dict[str, str]) -> str | None:
        if "value" in e:
            return expand(str(e["value"]), env)
        src = e.get("valueFrom") or {}
        for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            if key in src:
                ref = src[key]
                obj = self.objects[kind].get(ref["name"])
                if obj is None or ref["key"] not in obj:
                    assert ref.get("optional"), f"env {e['name']}: {kind} {ref['name']}/{ref['key']} missing"
                    return None
                return obj[ref["key"]]
        if "fieldRef" in src:
            return {"status.podIP": self.net.pod_ip, "metadata.name": self.name,
                    "metadata.namespace": self.namespace}[src["fieldRef"]["fieldPath"]]
        raise AssertionError(f"env {e}: unsupported source")

    def _wrap(self, c: Container, argv: list[str]) -> list[str]:
        """argv in the pod's network namespace (image mode: in the running container)."""
        if self.image is not None:
            return [*PODMAN, "exec", c.podman_name, *argv]
        return ["ip", "netns", "exec", self.net.netns, *argv]

    def security_context(self, c: Container) -> dict:
        """The container's effective securityContext: its own fields over the pod's."""
        pod_sc = {k: v for k, v in (self.spec.get("securityContext") or {}).items()
                  if k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")}
        return {**pod_sc, **(c.spec.get("securityContext") or {})}

    def _podman_run(self, c: Container) -> list[str]:
        """`podman run` of the container as the kubelet would run it (see the module docstring)."""
        sc = self.security_context(c)
        pod_sc = self.spec.get("securityContext") or {}
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup")
        if uid is None:
            user = podman("image", "inspect", "--format", "{{.Config.User}}", str(self.image)).stdout.strip()
            uid = user.split(":")[0] or "0"
        if sc.get("runAsNonRoot"):  # the kubelet refuses to start it: "container has runAsNonRoot and image
            assert str(uid).isdigit() and int(uid) != 0, f"{c.name}: runAsNonRoot, but it would run as {uid!r}"
        argv = [*PODMAN, "run", "--name", c.podman_name, "--pull", "never", "--network",
                f"ns:/run/netns/{self.net.netns}", "--hostname", self.name, "--user",
                f"{uid}:{gid}" if gid is not None else str(uid)]
        for group in [pod_sc.get("fsGroup"), *pod_sc.get("supplementalGroups", [])]:
            if group is not None:
                argv += ["--group-add", str(group)]
        if sc.get("readOnlyRootFilesystem"):
            argv += ["--read-only", "--read-only-tmpfs=false"]  # podman would add tmpfs on /tmp, /run...
        caps = sc.get("capabilities") or {}
        argv += [f"--cap-drop={cap}" for cap in caps.get("drop", [])]
        argv += [f"--cap-add={cap}" for cap in caps.get("add", [])]
        if sc.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        if sc.get("privileged"):
            argv.append("--privileged")
        seccomp = (sc.get("seccompProfile") or {}).get("type", "RuntimeDefault")
        assert seccomp in ("RuntimeDefault", "Unconfined"), f"{c.name}: seccomp {seccomp} not emulated"
        if seccomp == "Unconfined":
            argv += ["--security-opt", "seccomp=unconfined"]
        for m in c.spec.get("volumeMounts", []):
            assert "subPath" not in m, f"{c.name}: subPath not emulated"
            argv += ["-v", f"{self.volumes[m['name']]}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
        for name, value in c.env.items():
            if name != "HOSTNAME":
                argv += ["-e", f"{name}={value}"]
        if c.spec.get("workingDir"):
            argv += ["--workdir", c.spec["workingDir"]]
        command, args = c.spec.get("command"), [expand(a, c.env) for a in c.spec.get("args", [])]
        if command:
            argv += ["--entrypoint", json.dumps([expand(a, c.env) for a in command])]
        return [*argv, str(self.image), *args]

    def _cwd(self, c: Container) -> Path:
        return c.paths.get(IMAGE_WORKDIR, self.root)

    def _start(self, c: Container) -> None:
        c.log_path = self.root / f"{c.name}.log"
        with open(c.log_path, "ab") as log:
            if self.image is not None:
                podman("rm", "-f", "-t", "0", c.podman_name, check=False)  # a leftover of a killed run
                c.proc = subprocess.Popen(self._podman_run(c), env=podman_env(), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                return
            c.proc = subprocess.Popen(self._wrap(c, c.argv), env=c.env, cwd=self._cwd(c), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, ready_timeout: float = 180.0) -> None:
        """Volumes, then init containers in order (a native sidecar: started, startup probe passed),
        then the containers; returns once every container's startup probe passed and the first
        container is Ready (`ready_s`: how long that took)."""
        started = time.monotonic()
        self._make_volumes()
        for spec in self.spec.get("initContainers", []):
            c = self._container(spec, sidecar=spec.get("restartPolicy") == "Always")
            assert c.sidecar, "only native sidecars among the init containers here"
            self.containers[c.name] = c
        for spec in self.spec["containers"]:
            self.containers[spec["name"]] = self._container(spec, sidecar=False)
        self._fill_volumes()
        for c in self.containers.values():
            self._start(c)
            if c.sidecar:
                self.wait_probe(c.name, "startupProbe", timeout=ready_timeout)
        for name in [s["name"] for s in self.spec["containers"]]:
            self.wait_probe(name, "startupProbe", timeout=ready_timeout)
            self.wait_probe(name, "readinessProbe", timeout=ready_timeout)
        self.ready_s = time.monotonic() - started

    # ---- probes ----
    def container_port(self, container: str, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        spec = self.containers[container].spec if container in self.containers else \
            next(s for s in [*self.spec.get("initContainers", []), *self.spec["containers"]] if s["name"] == container)
        return next(p["containerPort"] for p in spec.get("ports", []) if p["name"] == port)

    def pod_port(self, name: str) -> int:
        """A named container port anywhere in the pod (what a targetPort / PodMonitor port names)."""
        for spec in [*self.spec.get("initContainers", []), *self.spec["containers"]]:
            for p in spec.get("ports", []):
                if p.get("name") == name:
                    return p["containerPort"]
        raise KeyError(name)

    def service_target(self, service_port: str | int) -> str:
        """pod IP:port behind the rendered Service's port (by name or number), via its targetPort."""
        (svc,) = [d for d in self.docs if d["kind"] == "Service"]
        port = next(p for p in svc["spec"]["ports"] if service_port in (p.get("name"), p["port"]))
        target = port.get("targetPort", port["port"])
        return f"{self.net.pod_ip}:{target if isinstance(target, int) else self.pod_port(target)}"

    def probe(self, container: str, kind: str, credentials: grpc.ChannelCredentials | None = None) -> tuple[bool, str]:
        """One probe attempt, as the kubelet makes it: (success, detail)."""
        c = self.containers[container]
        p = c.spec[kind]
        timeout = float(p.get("timeoutSeconds", 1))
        if "grpc" in p:
            target = f"{self.net.pod_ip}:{p['grpc']['port']}"
            with grpc.insecure_channel(target, options=NO_PROXY_GRPC) as ch:
                try:
                    r = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=p["grpc"].get("service", "")), timeout=timeout)
                except grpc.RpcError as e:
                    return False, f"grpc {e.code().name}"
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            return r.status == health_pb2.HealthCheckResponse.SERVING, status
        if "tcpSocket" in p:
            port = self.container_port(container, p["tcpSocket"]["port"])
            try:
                socket.create_connection((self.net.pod_ip, port), timeout=timeout).close()
                return True, "connected"
            except OSError as e:
                return False, str(e)
        if "exec" in p:
            return self.exec(container, p["exec"]["command"], timeout)
        raise AssertionError(f"{container} {kind}: unsupported handler {p}")

    def exec(self, container: str, command: list[str], timeout: float) -> tuple[bool, str]:
        c = self.containers[container]
        argv = [expand(a, c.env) if self.image else remap(expand(a, c.env), c.paths) for a in command]
        try:
            r = subprocess.run(self._wrap(c, argv), env=podman_env() if self.image else c.env, cwd=self._cwd(c),
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False, "timed out"
        return r.returncode == 0, f"exit {r.returncode}: {(r.stdout + r.stderr)[-500:]}"

    def wait_probe(self, container: str, kind: str, want: bool = True, timeout: float | None = None) -> float:
        """Runs the probe every periodSeconds until it reaches its threshold for `want`
        (successThreshold successes, or failureThreshold consecutive failures); returns the seconds
        that took. A startup probe that reaches failureThreshold is a failed container: raises."""
        p = self.containers[container].spec[kind]
        period = float(p.get("periodSeconds", 10))
        need = int(p.get("successThreshold", 1)) if want else int(p.get("failureThreshold", 3))
        give_up = int(p.get("failureThreshold", 3))
        started, streak, failures, detail = time.monotonic(), 0, 0, ""
        time.sleep(float(p.get("initialDelaySeconds", 0)))
        while True:
            self.assert_running(container)
            attempt = time.monotonic()
            ok, detail = self.probe(container, kind)
            streak = streak + 1 if ok == want else 0
            failures = 0 if ok else failures + 1
            if streak >= need:
                return time.monotonic() - started
            if want and kind == "startupProbe" and failures >= give_up:
                raise AssertionError(f"{container}: startup probe failed {failures}x ({detail})\n"
                                     f"{self.containers[container].log()[-3000:]}")
            if timeout is not None and time.monotonic() - started > timeout:
                raise TimeoutError(f"{container} {kind} not {'passing' if want else 'failing'} after {timeout}s: "
                                   f"{detail}\n{self.containers[container].log()[-3000:]}")
            time.sleep(max(0.0, period - (time.monotonic() - attempt)))

    def assert_running(self, container: str) -> None:
        c = self.containers[container]
        if c.proc is not None and c.proc.poll() is not None:
            raise AssertionError(f"{container} exited with {c.proc.returncode}:\n{c.log()[-4000:]}")

    # ---- termination ----
    def pre_stop(self, container: str) -> tuple[bool, str] | None:
        hook = (self.containers[container].spec.get("lifecycle") or {}).get("preStop")
        if not hook:
            return None
        return self.exec(container, hook["exec"]["command"], timeout=self.grace_s)

    def terminate(self, containers: Sequence[str] | None = None) -> dict[str, int]:
        """Kubelet termination of the main containers (preStop, SIGTERM, SIGKILL at the grace),
        then the sidecars; returns exit codes."""
        names = list(containers or [s["name"] for s in self.spec["containers"]])
        deadline = time.monotonic() + self.grace_s
        for n in names:
            self.pre_stop(n)
        codes = {}
        for group in (names, [c.name for c in self.containers.values() if c.sidecar]):
            for n in group:
                self._signal(n, signal.SIGTERM)
            for n in group:
                codes[n] = self._wait(n, max(1.0, deadline - time.monotonic()))
        return codes

    def _signal(self, name: str, sig: int) -> None:
        proc = self.containers[name].proc
        if proc is not None and proc.poll() is None:
            if sig == signal.SIGTERM:
                self.sigterm_at[name] = time.monotonic()
            if self.image is not None:  # the container's process, as the runtime delivers it
                podman("kill", "--signal", str(int(sig)), self.containers[name].podman_name, check=False)
            else:
                os.killpg(proc.pid, sig)

    def _wait(self, name: str, timeout: float) -> int:
        proc = self.containers[name].proc
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(name, signal.SIGKILL)
            return proc.wait(10)

    def close(self) -> None:
        for c in self.containers.values():
            if c.proc is not None and c.proc.poll() is None:
                self._signal(c.name, signal.SIGKILL)
                try:
                    c.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                    c.proc.wait(10)
            if self.image is not None:
                podman("rm", "-f", "-t", "0", c.podman_name, check=False)
        for path in self._tmpfs:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- image mode: what the containers did to the image and as whom they ran ----
    def root_writes(self, container: str) -> list[str]:
        """`podman diff`: what changed in the container's root filesystem (its volumes excluded), less
        what the runtime itself makes: the files it bind-mounts (as a kubelet does: /etc/hosts, ...) and
        the mount points of the volumes (with their parent dirs)."""
        c = self.containers[container]
        runtime = {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv"}
        mounts = [m["mountPath"] for m in c.spec.get("volumeMounts", [])]
        runtime |= {*mounts, *(re.sub(r"^/var/run/", "/run/", m) for m in mounts)}  # Debian: /var/run -> /run
        runtime |= {str(parent) for path in list(runtime) for parent in Path(path).parents}
        out = podman("diff", c.podman_name).stdout.split("\n")
        return [line for line in out if line.strip() and line.split(maxsplit=1)[-1] not in runtime]

    def process_ids(self, container: str) -> dict[int, dict[str, list[int]]]:
        """Every process of the running container: host pid -> its Uid/Gid (real, effective, saved,
        fs) and Groups, read from /proc on the host."""
        c = self.containers[container]
        pids = podman("top", c.podman_name, "hpid").stdout.split()[1:]
        ids = {}
        for pid in map(int, pids):
            try:
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
            except (FileNotFoundError, ProcessLookupError):  # gone since `podman top` (an exec probe), or while read
                continue
            fields = dict(line.split(":", 1) for line in status if ":" in line)
            ids[pid] = {k: [int(x) for x in fields[k].split()] for k in ("Uid", "Gid", "Groups")}
        return ids

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.log()[-3000:]}" for c in self.containers.values())


def _bytes(size: str | int) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(size))
    assert m, size
    units = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}
    return int(m[1]) * units[m[2]]


@contextmanager
def running_pod(docs: list[dict], cluster: dict, **kw: object) -> Iterator[Pod]:
    """A started pod in its own network namespace (image=TAG: its containers in that image); everything
    torn down afterwards."""
    with PodNetwork() as net:
        pod = Pod(docs, cluster, net, **kw)  # type: ignore[arg-type]
        try:
            pod.start()
            yield pod
        except BaseException:
            print(pod.logs(), file=sys.stderr)
            raise
        finally:
            pod.close()
