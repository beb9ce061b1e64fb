"""Pods of Kubernetes manifests run as processes on namespace hosts: a cluster without an API server.

:class:`PodCluster` puts each pod (:func:`tests.support.kubernetes_pods.pod_of`) on a host of its own of a
:class:`conformance_tests.multihost.Cluster` -- the host named like the pod, with the pod's host name and its
own address -- and starts the pod's argv there, with the pod's environment on top of this process's (standing
for the image's) and the container's ``workingDir`` mapped to a local directory. Names resolve as in a
cluster, through every host's ``/etc/hosts``, rewritten whenever a pod starts or is deleted:

* the kubelet's own line in each pod: its address, its FQDN (``HOSTNAME.SUBDOMAIN.NAMESPACE.svc.cluster.local``
  when the pod spec has a ``subdomain``) and its host name;
* cluster DNS: each Service of :meth:`PodCluster.add_service` -> the address of the pod behind it (the tests'
  servers are one pod each: no ClusterIP proxying); the training operator's per-pod Service of each live
  PyTorchJob worker (``JOB-worker-I`` -> its address); ``HOSTNAME.SUBDOMAIN`` of each live pod whose spec has
  a ``subdomain`` (a headless Service's records).

:meth:`PodCluster.delete` is the pod's deletion: every process on its host is killed (SIGKILL), or, with a grace
period, as the kubelet deletes a pod gracefully (SIGTERM to the container's main process, SIGKILL to what is left
after the pod's ``terminationGracePeriodSeconds``); its names leave DNS. A pod created again (a controller's
replacement) is a new host with a new address and the old one's host name: named like the new pod (an Indexed
Job's, with a new ``suffix``), or ``POD-N`` for its N-th re-creation where the controller reuses the pod's name
(a PyTorchJob's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from conformance_tests.multihost import Cluster, Host
from tests.support.kubernetes_pods import Pod, pod_names, pod_of

__all__ = ["PodCluster", "RunningPod", "LAUNCHER"]

#: What ``rdzv-run`` (a container's command) runs here: this checkout's launcher under this interpreter.
LAUNCHER = (sys.executable, "-m", "rdzv_agent.launch.launcher")
#: Variables of this process that a pod must not inherit (a pod gets its launcher's options from its spec only).
_NOT_INHERITED = ("PET_", "RDZV_", "TORCHELASTIC_")


@dataclass
class RunningPod:
    """A pod started by :meth:`PodCluster.start`: its :class:`Pod`, host and process (stdout, stderr in files)."""

    pod: Pod
    host: Host
    proc: Any  # subprocess.Popen
    out_path: str
    err_path: str

    def wait(self, timeout: float) -> int:
        """The pod's exit status; ``AssertionError`` with its output's tail when not done in ``timeout`` s."""
        try:
            return int(self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pod {self.pod.name} did not exit within {timeout} s\n{self.tail()}") from None

    def stdout(self) -> str:
        with open(self.out_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, chars: int = 3000) -> str:
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            err = f.read()[-chars:]
        return f"--- pod {self.pod.name} stdout ---\n{self.stdout()[-chars:]}\n--- stderr ---\n{err}"


class PodCluster:
    """Pods on namespace hosts, with DNS as a cluster's (module docstring).

    Args:
        cluster: an empty-enough :class:`Cluster` (its existing hosts are not pods and get no records).
        workdir: where the pods' output files go.
        working_dirs: a container ``workingDir`` (path in the image) -> the local directory standing for it.
        namespace: the pods' namespace (for FQDNs and ``metadata.namespace``).
    """

    def __init__(self, cluster: Cluster, workdir: str, working_dirs: Mapping[str, str],
                 namespace: str = "default") -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.working_dirs = dict(working_dirs)
        self.namespace = namespace
        self.pods: list[RunningPod] = []  # live pods, in start order
        self.services: dict[str, RunningPod] = {}
        self._subdomains: dict[str, str | None] = {}

    def start(self, obj: Mapping[str, Any], index: int, *, suffix: str = "", owner_uid: str | None = None,
              replace_args: Mapping[str, Sequence[str]] | None = None,
              env: Mapping[str, str] | None = None) -> RunningPod:
        """Create pod ``index`` of workload ``obj`` on a new host and start its container's argv there.

        Args:
            suffix, owner_uid: as :func:`pod_of`'s (an Indexed Job pod's name suffix; the workload's uid).
            replace_args: argv item -> the items to put in its place (e.g. the training script -> a test
                worker and its options); an item of the map not in the argv is a ``ValueError``.
            env: variables of the image's environment (under the pod's own).

        Raises:
            ValueError: see :func:`pod_of`; a ``replace_args`` key not in the argv.
        """
        name, hostname = pod_names(obj, index, suffix)
        used, host_name, again = {h.name for h in self.cluster}, name, 0
        while host_name in used:  # the pod created again under its name: a new host all the same
            again += 1
            host_name = f"{name}-{again}"
        host = self.cluster.add_host(host_name, hostname=hostname)
        pod = pod_of(obj, index, pod_ip=host.address, namespace=self.namespace, suffix=suffix,
                     **({"owner_uid": owner_uid} if owner_uid else {}))
        argv = list(pod.argv)
        for old, new in (replace_args or {}).items():
            if old not in argv:
                raise ValueError(f"{old!r} is not in pod {pod.name}'s argv {argv}")
            at = argv.index(old)
            argv[at:at + 1] = list(new)
        if argv[0] == "rdzv-run":
            argv[:1] = LAUNCHER
        image_env = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_INHERITED)}
        full_env = {**image_env, **(env or {}), **pod.env}
        cwd = self.working_dirs[pod.working_dir] if pod.working_dir else self.workdir
        out_path = os.path.join(self.workdir, f"{host.name}.out")
        err_path = os.path.join(self.workdir, f"{host.name}.err")
        self._subdomains[host.name] = _template(obj)["spec"].get("subdomain")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = host.popen(argv, env=full_env, cwd=cwd, stdout=out, stderr=err)
        running = RunningPod(pod, host, proc, out_path, err_path)
        self.pods.append(running)
        self.publish()
        return running

    def add_service(self, name: str, pod: RunningPod) -> None:
        """A Service ``name`` whose one endpoint is ``pod`` (its DNS name resolves to the pod's address)."""
        self.services[name] = pod
        self.publish()

    def delete(self, pod: RunningPod, grace: float | None = None) -> None:
        """Delete ``pod`` and take its names out of DNS.

        ``grace`` None: every process on its host gets SIGKILL at once (a lost node, an eviction without
        grace). Otherwise the kubelet's graceful deletion: SIGTERM to the container's main process only (the
        container's PID 1, here the pod's command), then, after ``grace`` seconds (the pod's
        ``terminationGracePeriodSeconds``) or once it has exited, SIGKILL to whatever is left on the host.
        """
        if grace is not None:
            pod.proc.send_signal(signal.SIGTERM)
            try:
                pod.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        pod.host.kill()
        pod.proc.wait(10)
        self.pods.remove(pod)
        self.services = {k: v for k, v in self.services.items() if v is not pod}
        self.publish()

    def records(self) -> list[tuple[str, str]]:
        """Cluster DNS now: ``(address, name)`` of each Service, operator Service and headless record."""
        found = [(pod.host.address, name) for name, pod in self.services.items()]
        for running in self.pods:
            pod = running.pod
            if "training.kubeflow.org/job-name" in pod.labels:  # the operator's Service per worker pod
                found.append((running.host.address, pod.name))
            subdomain = self._subdomains.get(running.host.name)
            if subdomain:  # the headless Service's record, short (the search domain) and full
                found.append((running.host.address, f"{pod.hostname}.{subdomain} "
                              f"{pod.hostname}.{subdomain}.{self.namespace}.svc.cluster.local"))
        return found

    def publish(self) -> None:
        """Write every pod host's ``/etc/hosts``: the kubelet's line for the pod, then :meth:`records`."""
        dns = self.records()
        for running in self.pods:
            pod, host = running.pod, running.host
            subdomain = self._subdomains.get(host.name)
            own = f"{pod.hostname}.{subdomain}.{self.namespace}.svc.cluster.local {pod.hostname}" if subdomain \
                else pod.hostname
            host.set_hosts(extra=[(host.address, own), *dns])


def _template(obj: Mapping[str, Any]) -> Any:
    """The pod template of workload ``obj`` (a PyTorchJob's Worker's, a Job's, a StatefulSet's)."""
    spec = obj["spec"]
    return spec["pytorchReplicaSpecs"]["Worker"]["template"] if obj["kind"] == "PyTorchJob" else spec["template"]
