"""Kubernetes manifests' pods as processes: what a pod's container runs, with what environment, under what name.

No API server runs in the tests. :func:`load` reads a manifest (YAML, several documents); :func:`pod_of` turns
one pod of a workload in it into a :class:`Pod` -- its name, its host name, its container's argv and environment
-- the way the controller that makes the pod and the kubelet that starts it would. The multi-host tests start
each pod's argv on a namespace host of its own (``conformance_tests.multihost``) and resolve Service names
through the hosts' ``/etc/hosts``, as cluster DNS would.

Sources of the rules (read from the code, cited so that a change there can be followed here):

* PyTorchJob (Kubeflow training-operator v1, the last release of its v1 API, commit 7858371b4^ of
  github.com/kubeflow/training-operator): pods are named ``JOB-worker-INDEX`` and labelled
  ``training.kubeflow.org/{job-name,replica-type,replica-index,operator-name}``
  (``pkg/controller.v1/common/pod.go`` ``createNewPod``, ``pkg/apis/kubeflow.org/v1/common_types.go``); the
  container's own ``env`` comes first, then the operator appends (``pkg/controller.v1/pytorch/envvar.go``
  ``setPodEnv``, ``elastic.go``): ``PYTHONUNBUFFERED=1``; ``PET_NPROC_PER_NODE`` = ``spec.nprocPerNode``
  (defaulted to ``"auto"`` when neither it nor ``elasticPolicy.nProcPerNode`` is set:
  ``pkg/apis/kubeflow.org/v1/pytorch_defaults.go``); then with an ``elasticPolicy``: ``PET_RDZV_ENDPOINT``
  = ``rdzvHost:rdzvPort`` (default host ``JOB-worker-0``), ``PET_RDZV_BACKEND`` (default ``c10d``),
  ``PET_NNODES`` = ``minReplicas:maxReplicas`` (both defaulted from each other, or from the Worker replicas),
  ``PET_MAX_RESTARTS`` (if set), ``PET_NPROC_PER_NODE`` from the deprecated ``elasticPolicy.nProcPerNode`` (if
  set), ``PET_RDZV_ID`` from ``rdzvId`` only (if set: the operator does not use the job's name),
  ``PET_RDZV_CONF`` = ``k1=v1,k2=v2`` from ``rdzvConf``, ``PET_STANDALONE`` (if ``standalone``). No Master
  replica: no ``MASTER_ADDR``, ``RANK`` or ``WORLD_SIZE``.
* Indexed Job (Kubernetes ``pkg/controller/job/indexed_job_utils.go``, the batch/v1 API reference): pods are
  named ``JOB-INDEX-XXXXX`` (a random suffix, new for a replacement pod), their host name is ``JOB-INDEX``,
  the completion index is the annotation and label ``batch.kubernetes.io/job-completion-index`` and the
  variable ``JOB_COMPLETION_INDEX`` appended to each container's env; the labels
  ``batch.kubernetes.io/job-name``, ``job-name``, ``batch.kubernetes.io/controller-uid`` and ``controller-uid``
  name the Job and its uid.
* StatefulSet: pod ``NAME-ORDINAL``, host name the same.
* The kubelet (``pkg/kubelet/kubelet_pods.go`` ``makeEnvironmentVariables``, ``third_party/forked/golang/
  expansion``): ``HOSTNAME`` = the pod's host name; each ``env`` entry in order, ``$(VAR)`` in a value
  expanded from the entries before it; ``valueFrom.fieldRef`` (the downward API) of ``metadata.name``,
  ``metadata.namespace``, ``metadata.uid``, ``metadata.labels['K']``, ``metadata.annotations['K']``,
  ``status.podIP``; a later entry of the same name wins; ``$(VAR)`` in ``command`` and ``args`` expanded from
  the whole environment, ``$$`` an escaped ``$``, an unknown ``$(VAR)`` kept as written. argv = ``command``
  + ``args``.

Not modelled (the manifests here use none of it): the image's own entrypoint and ``ENV`` (a container without
``command`` is an error here), Service-link variables (``RDZV_REDIS_SERVICE_HOST``, ...), ``envFrom``,
ConfigMap and Secret references, resource fields.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

__all__ = ["Pod", "load", "find", "pod_names", "pod_of", "expand"]


@dataclass(frozen=True)
class Pod:
    """One pod of a workload, as the kubelet would start its (first) container.

    Attributes:
        name: the pod's name (``metadata.name``).
        hostname: its host name (what ``hostname`` answers in it).
        argv: the container's ``command`` + ``args``, ``$(VAR)`` expanded.
        env: the container's environment (name -> value) from the pod spec, the controller and the kubelet.
        working_dir: the container's ``workingDir`` (a path in its image), or ``None``.
        labels, annotations: the pod's metadata (name -> value).
        termination_grace: seconds between the kubelet's SIGTERM and its SIGKILL when the pod is deleted
            (``terminationGracePeriodSeconds``, Kubernetes' default 30).
    """

    name: str
    hostname: str
    argv: list[str]
    env: dict[str, str]
    working_dir: str | None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    termination_grace: float = 30.0


def load(path: str) -> list[dict[str, Any]]:
    """The objects of the YAML manifest at ``path`` (empty documents skipped), in file order."""
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``, if given) in ``objects``.

    Raises:
        LookupError: none, or more than one.
    """
    found = [o for o in objects if o.get("kind") == kind and name in (None, o["metadata"]["name"])]
    if len(found) != 1:
        raise LookupError(f"{len(found)} objects of kind {kind} named {name or '(any)'}")
    return found[0]


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of ``text``: ``$(VAR)`` -> its value if ``VAR`` is in ``env`` (else
    kept as written), ``$$`` -> ``$``."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(one, text)


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def _field(path: str, pod: Mapping[str, Any]) -> str:
    """The downward API's value of ``fieldRef.fieldPath`` ``path`` for ``pod`` (a dict of its metadata).

    Raises:
        ValueError: a field path not supported here, or a label or annotation the pod does not have.
    """
    simple = {"metadata.name": pod["name"], "metadata.namespace": pod["namespace"], "metadata.uid": pod["uid"],
              "status.podIP": pod["pod_ip"]}
    if path in simple:
        return str(simple[path])
    m = _FIELD.match(path)
    if m is None:
        raise ValueError(f"fieldRef {path!r} is not supported here")
    values = pod[m.group(1)]
    if m.group(2) not in values:
        raise ValueError(f"fieldRef {path!r}: the pod has no such {m.group(1)[:-1]}")
    return str(values[m.group(2)])


def _pytorchjob_env(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The variables the training operator appends to a worker container of PyTorchJob ``job`` (in its order)."""
    spec = job["spec"]
    policy = spec.get("elasticPolicy")
    name = job["metadata"]["name"]
    added = [("PYTHONUNBUFFERED", "1")]
    nproc = spec.get("nprocPerNode")
    if nproc is None and (policy is None or policy.get("nProcPerNode") is None):
        nproc = "auto"  # the operator's default
    if nproc is not None:
        added.append(("PET_NPROC_PER_NODE", str(nproc)))
    workers = spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1)
    if policy is None:
        return [*added, ("PET_NNODES", str(workers))]
    port = policy.get("rdzvPort")
    if port is None:  # the port named "pytorchjob-port" of the container named "pytorch"
        containers = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        ports = [p["containerPort"] for c in containers if c["name"] == "pytorch" for p in c.get("ports", [])
                 if p.get("name") == "pytorchjob-port"]
        port = ports[0] if ports else 23456  # the operator's defaulted port
    lo, hi = policy.get("minReplicas"), policy.get("maxReplicas")
    lo, hi = (lo if lo is not None else hi if hi is not None else workers), (hi if hi is not None else lo
                                                                             if lo is not None else workers)
    added += [("PET_RDZV_ENDPOINT", f"{policy.get('rdzvHost', f'{name}-worker-0')}:{port}"),
              ("PET_RDZV_BACKEND", str(policy.get("rdzvBackend", "c10d"))), ("PET_NNODES", f"{lo}:{hi}")]
    if policy.get("maxRestarts") is not None:
        added.append(("PET_MAX_RESTARTS", str(policy["maxRestarts"])))
    if policy.get("nProcPerNode") is not None:
        added.append(("PET_NPROC_PER_NODE", str(policy["nProcPerNode"])))
    if policy.get("rdzvId") is not None:
        added.append(("PET_RDZV_ID", str(policy["rdzvId"])))
    if policy.get("rdzvConf"):
        added.append(("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])))
    if policy.get("standalone"):
        added.append(("PET_STANDALONE", ""))
    return added


def pod_names(obj: Mapping[str, Any], index: int, suffix: str = "") -> tuple[str, str]:
    """``(pod name, host name)`` of pod ``index`` of workload ``obj`` (see :func:`pod_of`).

    Raises:
        ValueError: a kind not handled here.
    """
    kind, name = obj["kind"], obj["metadata"]["name"]
    if kind == "PyTorchJob":
        return f"{name}-worker-{index}", f"{name}-worker-{index}"
    if kind == "Job":
        return (f"{name}-{index}-{suffix}" if suffix else f"{name}-{index}"), f"{name}-{index}"
    if kind == "StatefulSet":
        return f"{name}-{index}", f"{name}-{index}"
    raise ValueError(f"kind {kind} is not a workload handled here")


def pod_of(obj: Mapping[str, Any], index: int, *, pod_ip: str, namespace: str = "default",
           owner_uid: str = "00000000-0000-4000-8000-000000000000", suffix: str = "") -> Pod:
    """Pod ``index`` of workload ``obj`` (a PyTorchJob's Worker, an Indexed Job's completion index, a
    StatefulSet's ordinal), as its controller and the kubelet would make and start it (module docstring).

    Args:
        obj: the workload object, as :func:`load` gives it.
        index: the worker index, completion index or ordinal (int >= 0).
        pod_ip: the pod's address (``status.podIP``).
        namespace: the pod's namespace.
        owner_uid: the workload's uid (a Job's ``controller-uid`` label).
        suffix: an Indexed Job pod's random name suffix (5 characters; a replacement pod gets a new one).

    Returns:
        the :class:`Pod`, whose ``argv`` and ``env`` come from the template's first container.

    Raises:
        ValueError: a kind not handled here, a Job that is not Indexed, an index out of range, a container
            without ``command``, an ``env`` source not supported here (module docstring).
    """
    kind, name = obj["kind"], obj["metadata"]["name"]
    pod_name, hostname = pod_names(obj, index, suffix)
    annotations: dict[str, str] = {}
    added: list[tuple[str, str]] = []
    if kind == "PyTorchJob":
        replica = obj["spec"]["pytorchReplicaSpecs"]["Worker"]
        count = replica.get("replicas", 1)
        policy = obj["spec"].get("elasticPolicy") or {}
        count = max(count, policy.get("maxReplicas") or 0)  # scaled up to maxReplicas at most
        template = replica["template"]
        labels = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/replica-type": "worker",
                  "training.kubeflow.org/replica-index": str(index),
                  "training.kubeflow.org/operator-name": "pytorchjob-controller"}
        added = _pytorchjob_env(obj)
    elif kind == "Job":
        spec = obj["spec"]
        if spec.get("completionMode") != "Indexed":
            raise ValueError(f"Job {name}: only completionMode Indexed is handled here")
        count = spec.get("completions", 1)
        template = spec["template"]
        labels = {"batch.kubernetes.io/job-name": name, "job-name": name, "batch.kubernetes.io/controller-uid":
                  owner_uid, "controller-uid": owner_uid, "batch.kubernetes.io/job-completion-index": str(index)}
        annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
        added = [("JOB_COMPLETION_INDEX", str(index))]
    elif kind == "StatefulSet":
        count = obj["spec"].get("replicas", 1)
        template = obj["spec"]["template"]
        labels = {"statefulset.kubernetes.io/pod-name": pod_name, "apps.kubernetes.io/pod-index": str(index)}
    else:  # pod_names raised already
        raise AssertionError(kind)
    if not 0 <= index < count:
        raise ValueError(f"{kind} {name}: pod index {index} not in 0..{count - 1}")
    labels = {**(template.get("metadata") or {}).get("labels", {}), **labels}
    annotations = {**(template.get("metadata") or {}).get("annotations", {}), **annotations}
    container = template["spec"]["containers"][0]
    if "command" not in container:
        raise ValueError(f"{kind} {name}: container {container['name']} has no command (image entrypoints are "
                         "not known here)")
    facts = {"name": pod_name, "namespace": namespace, "uid": str(uuid.uuid4()), "pod_ip": pod_ip,
             "labels": labels, "annotations": annotations}
    env: dict[str, str] = {"HOSTNAME": hostname}
    for entry in container.get("env", []):
        if "value" in entry or "valueFrom" not in entry:
            env[entry["name"]] = expand(str(entry.get("value", "")), env)
        elif set(entry["valueFrom"]) == {"fieldRef"}:
            env[entry["name"]] = _field(entry["valueFrom"]["fieldRef"]["fieldPath"], facts)
        else:
            raise ValueError(f"env {entry['name']}: only values and fieldRef are supported here")
    for key, value in added:
        env[key] = value
    argv = [expand(str(a), env) for a in [*container["command"], *container.get("args", [])]]
    grace = float(template["spec"].get("terminationGracePeriodSeconds", 30))
    return Pod(pod_name, hostname, argv, env, container.get("workingDir"), labels, annotations, grace)
