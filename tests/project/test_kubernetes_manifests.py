"""examples/kubernetes/: the manifests' schema (offline) and what each pod's ``rdzv-run`` makes of its spec.

Schema: every object deserializes into the ``kubernetes`` client's models (Service, StatefulSet, Job) or
``kubeflow-training``'s (PyTorchJob), with unknown fields and wrongly typed values refused
(tests/support/kubernetes_schema.py); a misspelled field, a string for an integer and a missing required field
each fail the check. Pods: each pod's argv and environment (tests/support/kubernetes_pods.py: the training
operator's ``PET_*`` variables, the downward API, ``$(VAR)`` expansion) parsed by ``rdzv-run``'s own option
parser give the rendezvous the manifest means: the backend and Service, the run id, the node counts, the
restarts. The pods running on hosts: tests/multihost/test_kubernetes.py.
"""

from __future__ import annotations

import copy
import glob
import os

import pytest

from rdzv_agent.launch import args as launch_args
from rdzv_agent.launch import config as launch_config
from tests.support.agent_workers.harness import REPO
from tests.support.kubernetes_pods import expand, find, load, pod_of
from tests.support.kubernetes_schema import ManifestError, check, problems

pytest.importorskip("kubernetes", reason="the test extra's kubernetes client")
pytest.importorskip("kubeflow.training", reason="the test extra's kubeflow-training")

HERE = os.path.join(REPO, "examples", "kubernetes")
MANIFESTS = sorted(glob.glob(os.path.join(HERE, "*.yaml")))
OBJECTS = [(os.path.basename(path), i, obj) for path in MANIFESTS for i, obj in enumerate(load(path))]
PYTORCHJOB = load(os.path.join(HERE, "pytorchjob-elastic.yaml"))
INDEXED = load(os.path.join(HERE, "indexed-job.yaml"))


def test_the_examples_are_there() -> None:
    assert [os.path.basename(p) for p in MANIFESTS] == ["indexed-job.yaml", "pytorchjob-elastic.yaml"]
    assert sorted(o["kind"] for o in PYTORCHJOB) == ["PyTorchJob", "Service", "StatefulSet"]
    assert sorted(o["kind"] for o in INDEXED) == ["Job", "Service", "Service", "StatefulSet"]


@pytest.mark.parametrize("obj", [o for _, _, o in OBJECTS], ids=[f"{f}:{i}:{o['kind']}" for f, i, o in OBJECTS])
def test_each_object_matches_its_schema(obj) -> None:
    model = check(obj)
    assert type(model).__name__ == {"Service": "V1Service", "StatefulSet": "V1StatefulSet", "Job": "V1Job",
                                    "PyTorchJob": "KubeflowOrgV1PyTorchJob"}[obj["kind"]]
    assert model.metadata.name == obj["metadata"]["name"]


def _broken(objects, kind: str, change) -> dict:
    obj = copy.deepcopy(find(objects, kind))
    change(obj)
    return obj


@pytest.mark.parametrize("kind, change, named", [
    ("PyTorchJob", lambda o: o["spec"]["elasticPolicy"].update(minReplica=2),
     "PyTorchJob.spec.elasticPolicy.minReplica: unknown field"),
    ("PyTorchJob", lambda o: o["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
     .update(workingdir="/workspace"), "containers[0].workingdir: unknown field of V1Container"),
    ("Job", lambda o: o["spec"].update(completionmode="Indexed"), "Job.spec.completionmode: unknown field"),
    ("Job", lambda o: o["spec"].update(parallelism="3"), "Job.spec.parallelism: expected int"),
    ("StatefulSet", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(args="--appendonly yes"),
     "containers[0].args: expected a list"),
], ids=["elasticPolicy-misspelled", "container-misspelled", "job-misspelled", "int-as-string", "args-not-list"])
def test_a_wrong_field_fails_the_check(kind, change, named) -> None:
    objects = PYTORCHJOB if kind == "PyTorchJob" else INDEXED
    broken = _broken(objects, kind, change)
    with pytest.raises(ManifestError) as caught:
        check(broken)
    assert any(named in p for p in caught.value.problems), caught.value.problems


def test_a_missing_required_field_fails_the_check() -> None:
    broken = _broken(INDEXED, "Job", lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"))
    assert problems(broken) == []  # nothing unknown ...
    with pytest.raises(ManifestError, match="name"):  # ... but the client's model requires a container name
        check(broken)


def test_an_unknown_kind_or_api_version_is_refused() -> None:
    with pytest.raises(ValueError, match="no schema for kind"):
        problems({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}})
    wrong = _broken(PYTORCHJOB, "PyTorchJob", lambda o: o.update(apiVersion="kubeflow.org/v2"))
    assert problems(wrong) == ["apiVersion: 'kubeflow.org/v2', expected 'kubeflow.org/v1' for PyTorchJob"]


def _launch(pod, monkeypatch) -> launch_config.LaunchConfig:
    """What ``rdzv-run`` makes of ``pod``'s argv under its environment (its PET_* variables read as torchrun's)."""
    for key in [k for k in os.environ if k.startswith(("PET_", "RDZV_"))]:
        monkeypatch.delenv(key)
    for key, value in pod.env.items():
        monkeypatch.setenv(key, value)
    assert pod.argv[0] == "rdzv-run"
    return launch_config.build_config(launch_args.parse_args(pod.argv[1:]), pod.env)


def test_a_pytorchjob_worker_gets_the_operators_variables(monkeypatch) -> None:
    pod = pod_of(find(PYTORCHJOB, "PyTorchJob"), 2, pod_ip="10.1.2.3")
    assert (pod.name, pod.hostname) == ("train-digits-worker-2", "train-digits-worker-2")
    assert {k: v for k, v in pod.env.items() if k.startswith("PET_")} == {
        "PET_RDZV_ID": "train-digits", "PET_NPROC_PER_NODE": "1", "PET_RDZV_ENDPOINT": "rdzv-redis:6379",
        "PET_RDZV_BACKEND": "rdzv-redis", "PET_NNODES": "2:3", "PET_MAX_RESTARTS": "3",
        "PET_RDZV_CONF": "last_call_timeout=5"}
    config = _launch(pod, monkeypatch)
    url = config.target
    assert (url.scheme, url.hosts, url.run_id) == ("redis", (("rdzv-redis", 6379),), "train-digits")
    assert (url.params["min_nodes"], url.params["max_nodes"], url.params["last_call_timeout"]) == (2, 3, 5.0)
    assert (config.max_restarts, config.nproc_per_node) == (3, 1)
    assert config.program_args[-1:] == ["examples/train_digits.py"]  # run by the Python interpreter


def test_an_indexed_job_pod_gives_its_options_on_the_command_line(monkeypatch) -> None:
    uid = "3c0ffee0-1111-4222-8333-444455556666"
    pod = pod_of(find(INDEXED, "Job"), 1, pod_ip="10.1.2.4", suffix="x7k2q", owner_uid=uid)
    assert (pod.name, pod.hostname, pod.env["JOB_COMPLETION_INDEX"]) == ("train-indexed-1-x7k2q",
                                                                         "train-indexed-1", "1")
    config = _launch(pod, monkeypatch)
    url = config.target
    assert (url.scheme, url.hosts, url.run_id) == ("redis", (("rdzv-redis", 6379),), f"train-indexed-{uid}")
    assert (url.params["min_nodes"], url.params["max_nodes"], url.params["last_call_timeout"]) == (2, 3, 5.0)
    assert (config.local_addr, config.max_restarts, config.nproc_per_node) == ("10.1.2.4", 3, 1)


def test_the_operator_defaults_and_the_kubelet_expansion() -> None:
    """Without nprocPerNode the operator sets PET_NPROC_PER_NODE=auto; without min/max replicas PET_NNODES is
    the Worker replicas; without rdzvHost/rdzvBackend: JOB-worker-0 and c10d; no rdzvId, no PET_RDZV_ID."""
    job = copy.deepcopy(find(PYTORCHJOB, "PyTorchJob"))
    del job["spec"]["nprocPerNode"]
    for key in ("minReplicas", "maxReplicas", "rdzvHost", "rdzvBackend"):
        del job["spec"]["elasticPolicy"][key]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"] = []
    env = pod_of(job, 0, pod_ip="10.1.2.5").env
    assert (env["PET_NPROC_PER_NODE"], env["PET_NNODES"], env["PET_RDZV_ENDPOINT"], env["PET_RDZV_BACKEND"]) == \
        ("auto", "3:3", "train-digits-worker-0:6379", "c10d")
    assert "PET_RDZV_ID" not in env
    assert expand("$(A)-$(B)-$$(A)-$(A", {"A": "x"}) == "x-$(B)-$(A)-$(A"
    with pytest.raises(ValueError, match="pod index 3"):
        pod_of(find(PYTORCHJOB, "PyTorchJob"), 3, pod_ip="10.1.2.6")
