"""A stand-in kubelet: runs the pods a real Kubernetes API server gives one node as local processes.

For running ``tests/integration/test_k8s_cluster.py`` against a bare control plane (kube-apiserver,
kube-controller-manager, etcd) on one machine, where no container runtime is::

    python tools/k8s_standin_kubelet.py --kubeconfig KUBECONFIG --volumes /tmp/claims \\
        --workdir . --python .venv/bin/python

What it does, as a kubelet and a scheduler would (and how it stands in for what it lacks):

- registers Node ``--node`` (Ready, its address 127.0.0.1) and keeps its Lease renewed, so the node
  controller neither taints it nor evicts its pods; binds every unscheduled pod of the namespace to it;
- runs each pod's one container as a process group: ``command`` + ``args`` with ``$(VAR)`` expanded,
  the image ignored, ``python`` replaced by ``--python``, in ``--workdir`` (the image's working dir);
  its environment is the pod's (``value``, ``fieldRef`` on the pod's metadata, ``secretKeyRef``,
  ``envFrom``), plus ``PATH``/``PYTHONPATH``/``HOME`` of its own;
- volumes: a Secret's items become files (their modes) in a directory of the pod's, an ``emptyDir``
  a directory, a PersistentVolumeClaim ``--volumes/<claim>``; a path under a ``mountPath`` (and the
  ``terminationMessagePath``) in the environment or command is rewritten to the local one;
- networking: each pod gets a loopback address of its own (127.1.x.y, its ``podIP``); every
  ``<host>.<subdomain>.<namespace>.svc`` name in a pod's environment or command (a headless Service's
  DNS names; no cluster DNS here) becomes the address of that pod, and a bind to ``0.0.0.0`` its own;
- status: Running once started, then Succeeded/Failed with the exit code (128+N for signal N), the
  reason and the termination message (``FallbackToLogsOnError``: the log's tail); a deleted pod's
  process gets SIGTERM, SIGKILL after its grace period, then the pod is marked Failed and removed;
- logs: an HTTPS server on 127.0.0.1:``--port`` answers the API server's ``/containerLogs/...``
  (``kubectl logs``, the launcher's log copy).

It polls the API server every ``--poll-s`` (a test program: simple over fast). It enforces no
securityContext, resources or image pull. It is not a kubelet: never point it at a real cluster.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.server
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

_SVC_NAME = re.compile(r"\b([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\."
                       r"([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\.svc(?:\.cluster\.local)?\b")
_FIELD = re.compile(r"^metadata\.(annotations|labels)\['(.+)'\]$")
_VAR = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_TAIL_BYTES = 2048


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable's value, ``$$`` a ``$``, an unknown one as is."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class Addresses:
    """A loopback address per pod DNS name (``host.subdomain.namespace``), the same for every pod."""

    def __init__(self) -> None:
        self._by_name: dict[str, str] = {}

    def of(self, host: str, subdomain: str, namespace: str) -> str:
        key = f"{host}.{subdomain}.{namespace}"
        if key not in self._by_name:
            n = len(self._by_name) + 1
            self._by_name[key] = f"127.1.{n // 250}.{n % 250 + 1}"
        return self._by_name[key]

    def rewrite(self, text: str) -> str:
        return _SVC_NAME.sub(lambda m: self.of(m.group(1), m.group(2), m.group(3)), text)


class Container:
    """One pod's process, its directories and how it ended."""

    def __init__(self, pod: Any, root: Path) -> None:
        self.name = pod.metadata.name
        self.namespace = pod.metadata.namespace
        self.uid = pod.metadata.uid
        self.spec = pod.spec.containers[0]
        self.dir = root / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "log"
        self.termination = self.dir / "termination-log"
        self.proc: subprocess.Popen | None = None
        self.started_at: dt.datetime | None = None
        self.kill_at: float | None = None  # SIGKILL then (the pod's deletion grace period)
        self.reported = False  # its terminal status went to the API server


class Kubelet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        config.load_kube_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api()
        self.coord = client.CoordinationV1Api()
        self.addresses = Addresses()
        self.containers: dict[str, Container] = {}  # pod uid -> its container
        self.root = Path(tempfile.mkdtemp(prefix="standin-kubelet-"))
        self.logs: dict[tuple[str, str], Path] = {}  # (namespace, pod) -> its log file
        self.removed: set[str] = set()  # uids of the pods this kubelet deleted for good
        self._beat = 0.0

    # -- the node ------------------------------------------------------------------------------
    def register(self) -> None:
        node = client.V1Node(metadata=client.V1ObjectMeta(name=self.args.node, labels={
            "kubernetes.io/hostname": self.args.node, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}))
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self.heartbeat(force=True)

    def heartbeat(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._beat < 10:
            return
        self._beat = time.monotonic()
        stamp = now()
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
        status = {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": "localhost"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.args.port}},
            "nodeInfo": {"kubeletVersion": "v1.36.0-standin", "architecture": "amd64", "operatingSystem": "linux",
                         "bootID": "", "containerRuntimeVersion": "standin://0", "kernelVersion": "", "kubeProxyVersion": "",
                         "machineID": "", "osImage": "standin", "systemUUID": ""},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in kubelet",
                            "lastHeartbeatTime": stamp.isoformat(), "lastTransitionTime": stamp.isoformat()}]}}
        self.core.patch_node_status(self.args.node, status)
        renew = {"spec": {"holderIdentity": self.args.node, "leaseDurationSeconds": 40,
                          "renewTime": stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
        try:
            self.coord.patch_namespaced_lease(self.args.node, "kube-node-lease", renew)
        except ApiException as e:
            if e.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", {
                "metadata": {"name": self.args.node, "namespace": "kube-node-lease"}, **renew})

    # -- one pass --------------------------------------------------------------------------------
    def step(self) -> None:
        self.heartbeat()
        ns = self.args.namespace
        for pod in self.core.list_namespaced_pod(ns, field_selector="spec.nodeName=").items:
            if pod.metadata.deletion_timestamp is None:
                body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod.metadata.name),
                                        target=client.V1ObjectReference(kind="Node", name=self.args.node))
                try:
                    self.core.create_namespaced_pod_binding(pod.metadata.name, ns, body, _preload_content=False)
                except ApiException as e:
                    if e.status not in (404, 409):
                        raise
        seen = set()
        for pod in self.core.list_namespaced_pod(ns, field_selector=f"spec.nodeName={self.args.node}").items:
            seen.add(pod.metadata.uid)
            self.sync(pod)
        for uid in [u for u in self.containers if u not in seen]:  # gone from the API: nothing may run on
            self.kill(self.containers.pop(uid), 0)

    def sync(self, pod: Any) -> None:
        c = self.containers.get(pod.metadata.uid)
        phase = pod.status.phase if pod.status else None
        if phase in ("Succeeded", "Failed") and pod.metadata.deletion_timestamp is not None:
            if pod.metadata.uid not in self.removed:  # ended, then deleted (its Job went): gone now
                self.removed.add(pod.metadata.uid)
                self.remove(pod)
            return
        if c is None:
            if phase in ("Succeeded", "Failed"):
                return
            if pod.metadata.deletion_timestamp is not None:  # deleted before it ran
                self.finish(pod, None, 137, "ContainerStatusUnknown", "deleted before it started")
                return
            c = self.containers[pod.metadata.uid] = Container(pod, self.root)
            self.start(pod, c)
            return
        if c.reported:
            return
        code = c.proc.poll() if c.proc else 137
        if code is None and pod.metadata.deletion_timestamp is not None:
            if c.kill_at is None:
                grace = pod.metadata.deletion_grace_period_seconds or 0
                c.kill_at = time.monotonic() + grace
                self.signal(c, signal.SIGTERM)
            elif time.monotonic() >= c.kill_at:
                self.signal(c, signal.SIGKILL)
            return
        if code is None:
            return
        code = 128 - code if code < 0 else code
        self.finish(pod, c, code, "Completed" if code == 0 else "Error", self.message(c, code))
        if pod.metadata.deletion_timestamp is not None:
            self.remove(pod)

    # -- the container -------------------------------------------------------------------------
    def start(self, pod: Any, c: Container) -> None:
        host = pod.spec.hostname or pod.metadata.name
        ip = self.addresses.of(host, pod.spec.subdomain, pod.metadata.namespace) if pod.spec.subdomain \
            else self.addresses.of(host, "pod", pod.metadata.namespace)
        mounts = self.mounts(pod, c)
        mounts[c.spec.termination_message_path or "/dev/termination-log"] = str(c.termination)
        env = self.environment(pod, c, ip)

        def local(value: str) -> str:
            for path, there in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    return there + value[len(path):]
            return self.addresses.rewrite(value).replace("0.0.0.0", ip)

        env = {k: local(v) for k, v in env.items()}
        argv = [local(expand(a, env)) for a in [*(c.spec.command or []), *(c.spec.args or [])]]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = self.args.python
        base = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "LANG") if k in os.environ}
        base["HOME"] = str(c.dir)
        c.started_at = now()
        with c.log.open("wb") as out:
            c.proc = subprocess.Popen(argv, cwd=self.args.workdir, env={**base, **env}, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.logs[(pod.metadata.namespace, pod.metadata.name)] = c.log
        self.patch(pod, "Running", ip, {"running": {"startedAt": c.started_at.isoformat()}}, ready=True)
        print(f"standin-kubelet: started {pod.metadata.name} as pid {c.proc.pid} at {ip}", flush=True)

    def mounts(self, pod: Any, c: Container) -> dict[str, str]:
        """Each volume mount's path -> the local directory standing in for it."""
        local: dict[str, str] = {}
        volumes = {v.name: v for v in pod.spec.volumes or []}
        for m in c.spec.volume_mounts or []:
            v = volumes[m.name]
            where = c.dir / "volumes" / m.name
            if v.persistent_volume_claim is not None:
                where = Path(self.args.volumes) / v.persistent_volume_claim.claim_name
            where.mkdir(parents=True, exist_ok=True)
            if v.secret is not None:
                secret = self.core.read_namespaced_secret(v.secret.secret_name, pod.metadata.namespace)
                items = v.secret.items or [client.V1KeyToPath(key=k, path=k) for k in (secret.data or {})]
                for item in items:
                    f = where / item.path
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_bytes(base64.b64decode(secret.data[item.key]))
                    f.chmod(item.mode if item.mode is not None else v.secret.default_mode or 0o644)
            local[m.mount_path] = str(where)
        return local

    def environment(self, pod: Any, c: Container, ip: str) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in c.spec.env_from or []:
            if source.secret_ref is not None:
                data = self.core.read_namespaced_secret(source.secret_ref.name, pod.metadata.namespace).data or {}
                env.update({(source.prefix or "") + k: base64.b64decode(v).decode() for k, v in data.items()})
            if source.config_map_ref is not None:
                data = self.core.read_namespaced_config_map(source.config_map_ref.name, pod.metadata.namespace).data
                env.update({(source.prefix or "") + k: v for k, v in (data or {}).items()})
        for e in c.spec.env or []:
            if e.value_from is None:
                env[e.name] = expand(e.value or "", env)
            elif e.value_from.field_ref is not None:
                env[e.name] = self.field(pod, e.value_from.field_ref.field_path, ip)
            elif e.value_from.secret_key_ref is not None:
                ref = e.value_from.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace).data or {}
                env[e.name] = base64.b64decode(data[ref.key]).decode()
        return env

    def field(self, pod: Any, path: str, ip: str) -> str:
        m = _FIELD.match(path)
        if m:
            return (getattr(pod.metadata, m.group(1)) or {}).get(m.group(2), "")
        simple = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
                  "metadata.uid": pod.metadata.uid, "spec.nodeName": self.args.node, "status.podIP": ip,
                  "status.hostIP": "127.0.0.1", "spec.serviceAccountName": pod.spec.service_account_name or ""}
        return simple[path]

    def message(self, c: Container, code: int) -> str:
        text = c.termination.read_text(errors="replace")[:4096] if c.termination.exists() else ""
        if not text.strip() and code != 0 and c.spec.termination_message_policy == "FallbackToLogsOnError":
            data = c.log.read_bytes()[-_TAIL_BYTES:]
            text = b"\n".join(data.splitlines()[-80:]).decode(errors="replace")
        return text

    def signal(self, c: Container, sig: int) -> None:
        if c.proc is not None and c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, c: Container, grace_s: float) -> None:
        self.signal(c, signal.SIGTERM)
        if c.proc is not None:
            try:
                c.proc.wait(timeout=grace_s or 0.1)
            except subprocess.TimeoutExpired:
                self.signal(c, signal.SIGKILL)

    # -- the API ---------------------------------------------------------------------------------
    def finish(self, pod: Any, c: Container | None, code: int, reason: str, message: str) -> None:
        stamp = now().isoformat()
        terminated = {"exitCode": code, "reason": reason, "message": message or None, "finishedAt": stamp,
                      "startedAt": (c.started_at.isoformat() if c and c.started_at else stamp)}
        self.patch(pod, "Succeeded" if code == 0 else "Failed", None, {"terminated": terminated}, ready=False)
        if c is not None:
            c.reported = True
        print(f"standin-kubelet: {pod.metadata.name} exited {code} ({reason})", flush=True)
        if c is None and pod.metadata.deletion_timestamp is not None:
            self.remove(pod)

    def patch(self, pod: Any, phase: str, ip: str | None, state: dict[str, Any], ready: bool) -> None:
        stamp = now().isoformat()
        name = pod.spec.containers[0].name
        flag = "True" if ready else "False"
        status: dict[str, Any] = {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": (pod.status.start_time or now()).isoformat() if pod.status else stamp,
            "conditions": [{"type": t, "status": s, "lastTransitionTime": stamp}
                           for t, s in (("Initialized", "True"), ("Ready", flag), ("ContainersReady", flag),
                                        ("PodScheduled", "True"))],
            "containerStatuses": [{"name": name, "image": pod.spec.containers[0].image, "imageID": "", "ready": ready,
                                   "restartCount": 0, "started": ready, "state": state}]}
        if ip:
            status.update(podIP=ip, podIPs=[{"ip": ip}])
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise

    def remove(self, pod: Any) -> None:
        """The kubelet's last word on a deleted pod: gone now (its finalizers, if any, hold it still)."""
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=pod.metadata.uid)))  # the body's wins
        except ApiException as e:
            if e.status not in (404, 409):
                raise


def serve_logs(kubelet: Kubelet, port: int, cert: str, key: str) -> None:
    """``GET /containerLogs/<namespace>/<pod>/<container>``: the pod's log, as the API server asks a kubelet."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            parts = self.path.split("?")[0].strip("/").split("/")
            log = kubelet.logs.get((parts[1], parts[2])) if len(parts) >= 3 and parts[0] == "containerLogs" else None
            if log is None or not log.exists():
                self.send_error(404, "no such container")
                return
            data = log.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    p.add_argument("--node", default="standin-0")
    p.add_argument("--namespace", default="default")
    p.add_argument("--volumes", required=True, help="directory holding each PersistentVolumeClaim's files")
    p.add_argument("--workdir", default=".", help="the image's working directory: where commands run")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs a container's `python`")
    p.add_argument("--port", type=int, default=10250, help="the log server's port (the node's kubelet port)")
    p.add_argument("--cert", required=True, help="the log server's TLS certificate (PEM)")
    p.add_argument("--key", required=True, help="its key (PEM)")
    p.add_argument("--poll-s", type=float, default=0.2)
    args = p.parse_args(argv)
    kubelet = Kubelet(args)
    serve_logs(kubelet, args.port, args.cert, args.key)
    kubelet.register()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"standin-kubelet: node {args.node} ready; pods of namespace {args.namespace} run here", flush=True)
    try:
        while not stop.is_set():
            try:
                kubelet.step()
            except ApiException as e:
                print(f"standin-kubelet: API error {e.status}: {e.reason}: {e.body}", flush=True)
            stop.wait(args.poll_s)
    except KeyboardInterrupt:
        pass
    for c in kubelet.containers.values():
        kubelet.kill(c, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
