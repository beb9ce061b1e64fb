"""examples/kubernetes/ without a cluster: each manifest's pods as real processes on hosts of their own.

Every pod -- the Redis StatefulSet's and each worker's -- runs its container's command with the environment its
controller and the kubelet would give it (tests/support/kubernetes_pods.py: the training operator's ``PET_*``
variables, the downward API, ``$(VAR)`` expansion) on a network-namespace host named like the pod, with its
own host name and address; Service names resolve through each host's ``/etc/hosts`` as cluster DNS would
(tests/support/kubernetes_cluster.py). ``rdzv-run`` is this checkout's launcher; the image's ``/workspace``
is this checkout, so ``examples/train_digits.py`` is the real script.

* the PyTorchJob's three workers run the manifest's command as written and train ``train_digits.py`` to the
  end at world size 3;
* the Indexed Job's three pods train to the end at world size 3, in the run named by the Job's name and uid;
* a pod deleted (every process on its host killed) and created again with a new address -- an Indexed Job's
  under a new pod name, a PyTorchJob's under its name: the run re-forms with it at world size 3 and the job
  completes;
* a pod deleted gracefully (SIGTERM, SIGKILL after its grace period): its launcher ends by itself and leaves the
  run open, the two others train on at world size 2, and its replacement rejoins them;
* the PyTorchJob started with minReplicas (2) workers trains at world size 2; a third worker (the job scaled to
  maxReplicas) joins and the world grows to 3.

Where the process group is not the point, a torch-free worker (tests/support/agent_workers/step_worker.py:
takes steps until a file exists, records its rank, world size and steps; ends on SIGTERM) takes the training
script's place in the pod's argv; everything else in the argv and environment is the manifest's.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.support.agent_workers.harness import HERE as WORKERS, REPO, accuracies, ints_after
from tests.support.kubernetes_cluster import PodCluster, RunningPod
from tests.support.kubernetes_pods import find, load
from tests.support.waiting import eventually

pytestmark = [pytest.mark.multihost, pytest.mark.launchers]

EXAMPLES = os.path.join(REPO, "examples", "kubernetes")
PYTORCHJOB = load(os.path.join(EXAMPLES, "pytorchjob-elastic.yaml"))
INDEXED = load(os.path.join(EXAMPLES, "indexed-job.yaml"))
SCRIPT = "examples/train_digits.py"  # the training script in both manifests' argv
STEP_WORKER = os.path.join(WORKERS, "step_worker.py")
SERVE = 30.0  # seconds for redis-server to listen
FORM = 120.0  # seconds for launchers to import torch, meet and start their workers (2 cores)
TRAIN = 240.0  # seconds for train_digits.py on three pods, from their start to their exit (2 cores)
FINISH = 60.0  # seconds for the pods to end once their workers are told to stop


class Site:
    """One test's cluster: the manifest's Redis pod behind its Service, and the pods the test starts."""

    def __init__(self, pods: PodCluster, objects: list[dict], workdir: str) -> None:
        self.pods = pods
        self.out = os.path.join(workdir, "records")
        self.started: list[RunningPod] = []  # the pods of start(), in order
        self.stop = os.path.join(workdir, "stop")
        self.env = {"TMPDIR": os.path.join(workdir, "tmp")}  # train_digits.py's checkpoint: this test's
        os.makedirs(self.env["TMPDIR"])
        server = pods.start(find(objects, "StatefulSet", "rdzv-redis"), 0)
        service = find(objects, "Service", "rdzv-redis")
        assert service["spec"]["selector"].items() <= server.pod.labels.items()  # the Service selects it
        (port,) = service["spec"]["ports"]
        assert port["port"] == port["targetPort"] == 6379  # as served, without a ClusterIP proxy
        pods.add_service("rdzv-redis", server)
        eventually(lambda: _listening(server, port["port"]), SERVE, "redis-server listening", server.tail)

    def start(self, obj: dict, index: int, real: bool = False, **kwargs) -> RunningPod:
        """Start pod ``index`` of ``obj``; unless ``real``, with the step worker in the script's place (its
        records in a directory of this pod's own: :meth:`records_of`)."""
        worker = {} if real else {SCRIPT: [STEP_WORKER, "--out", os.path.join(self.out, str(len(self.started))),
                                           "--until", self.stop, "--sigterm-exits"]}
        pod = self.pods.start(obj, index, replace_args=worker, env=self.env, **kwargs)
        self.started.append(pod)
        return pod

    def records_of(self, pod: RunningPod) -> list[dict]:
        """The records of ``pod``'s step workers (one per rank it ran), each with its file's ``mtime``."""
        out = os.path.join(self.out, str(self.started.index(pod)))
        found = []
        for entry in os.listdir(out) if os.path.isdir(out) else []:
            if entry.endswith(".json"):
                path = os.path.join(out, entry)
                with open(path) as f:
                    found.append({**json.load(f), "mtime": os.stat(path).st_mtime})
        return found

    def records(self) -> dict[int, dict]:
        """The newest record per rank of every pod's step workers."""
        found: dict[int, dict] = {}
        for pod in self.started:
            for record in self.records_of(pod):
                if record["rank"] not in found or record["mtime"] > found[record["rank"]]["mtime"]:
                    found[record["rank"]] = record
        return found

    def training_on(self, running: list[RunningPod], world: int) -> bool:
        """Whether ranks 0..world-1 each made a step at world size ``world``, one worker on each pod of
        ``running`` (its pid among the processes of that pod's host)."""
        records = {rank: r for rank, r in self.records().items() if r["world_size"] == world}
        if sorted(records) != list(range(world)) or any(r["steps"] < 1 for r in records.values()):
            return False
        hosts = sorted(p.host.name for p in running for r in records.values() if r["pid"] in p.host.processes())
        return hosts == sorted(p.host.name for p in running)

    def finish(self, running: list[RunningPod]) -> None:
        """Tell the workers to stop; every pod of ``running`` must exit 0, every rank done at its world size."""
        open(self.stop, "w").close()
        for pod in running:
            assert pod.wait(FINISH) == 0, self.tails(running)
        assert all(r["done"] for r in self.records().values()), self.records()

    def tails(self, running: list[RunningPod]) -> str:
        return "\n".join(p.tail() for p in running)


def _listening(server: RunningPod, port: int) -> bool:
    try:
        server.host.connect(server.host.address, port).close()
        return True
    except OSError:
        return False


@pytest.fixture
def site(rdzv_hosts, tmp_path):
    """``site(objects) -> Site``: an empty cluster with the manifest's Redis serving (all removed afterwards)."""
    def make(objects: list[dict]) -> Site:
        workdir = str(tmp_path)
        pods = PodCluster(rdzv_hosts([]), workdir, {"/workspace": REPO, "/data": str(tmp_path / "data")})
        os.makedirs(tmp_path / "data")
        return Site(pods, objects, workdir)
    return make


def _suffix() -> str:
    return uuid.uuid4().hex[:5]


def test_pytorchjob_workers_train_digits_as_written(site) -> None:
    here = site(PYTORCHJOB)
    job = find(PYTORCHJOB, "PyTorchJob")
    workers = [here.start(job, i, real=True) for i in range(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"])]
    assert [w.pod.name for w in workers] == [f"train-digits-worker-{i}" for i in range(3)]
    for worker in workers:
        assert worker.wait(TRAIN) == 0, here.tails(workers)
    out = "".join(w.stdout() for w in workers)  # rank 0's lines, on the pod that had rank 0
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert epochs and epochs[-1].startswith("epoch 20/20 world_size=3 "), out
    assert ints_after("WORLD_SIZE_SEEN", out)[-1:] == [3], out  # its last (re)start: at world size 3
    assert accuracies(out) and accuracies(out)[-1] > 0.9, out


def test_indexed_job_pods_train_to_the_end_at_world_size_3(site) -> None:
    here = site(INDEXED)
    job, uid = find(INDEXED, "Job"), str(uuid.uuid4())
    pods = [here.start(job, i, suffix=_suffix(), owner_uid=uid) for i in range(job["spec"]["parallelism"])]
    eventually(lambda: here.training_on(pods, 3), FORM, "three pods training at world size 3",
               lambda: here.tails(pods))
    here.finish(pods)
    assert {r["run_id"] for r in here.records().values()} == {f"train-indexed-{uid}"}  # the Job's name and uid


@pytest.mark.parametrize("kind", ["Job", "PyTorchJob"])
def test_a_deleted_pod_created_again_with_a_new_address_rejoins_and_the_job_completes(site, kind) -> None:
    """An Indexed Job's replacement pod gets a new name (and keeps the host name); a PyTorchJob's keeps both."""
    objects = INDEXED if kind == "Job" else PYTORCHJOB
    here = site(objects)
    job, uid = find(objects, kind), str(uuid.uuid4())

    def create(index: int) -> RunningPod:
        return here.start(job, index, **({"suffix": _suffix(), "owner_uid": uid} if kind == "Job" else {}))

    pods = [create(i) for i in range(3)]
    eventually(lambda: here.training_on(pods, 3), FORM, "three pods training at world size 3",
               lambda: here.tails(pods))
    lost = pods[1]
    here.pods.delete(lost)
    assert lost.proc.returncode is not None and lost.host.processes() == []
    replacement = create(1)  # the controller's new pod
    assert replacement.host.address != lost.host.address
    assert (replacement.pod.name != lost.pod.name) == (kind == "Job")
    assert replacement.host.run(["hostname"]).stdout.strip() == lost.pod.hostname
    now = [pods[0], replacement, pods[2]]
    eventually(lambda: here.training_on(now, 3), FORM, "the run re-formed with the new pod at world size 3",
               lambda: here.tails(now))
    here.finish(now)


def test_a_pod_deleted_gracefully_leaves_the_run_open_the_others_re_form_and_its_replacement_rejoins(site) -> None:
    """The kubelet's graceful deletion (SIGTERM to the container's command, SIGKILL after the pod's
    ``terminationGracePeriodSeconds``) of one of a PyTorchJob's three workers: its launcher passes SIGTERM to
    its worker and exits by itself within the grace period (143: ended by SIGTERM) without closing the run;
    the two others (``minReplicas``) train on at world size 2; the controller's replacement joins them (the run
    is still open) and the three finish."""
    here = site(PYTORCHJOB)
    job = find(PYTORCHJOB, "PyTorchJob")
    pods = [here.start(job, i) for i in range(3)]
    eventually(lambda: here.training_on(pods, 3), FORM, "three pods training at world size 3",
               lambda: here.tails(pods))
    lost, survivors = pods[1], [pods[0], pods[2]]
    here.pods.delete(lost, grace=lost.pod.termination_grace)
    assert lost.proc.returncode == 143, f"the launcher did not end by itself on SIGTERM\n{lost.tail()}"
    (seen,) = here.records_of(lost)  # its one worker's
    assert seen["signals"] == ["SIGTERM"] and not seen["done"], seen
    eventually(lambda: here.training_on(survivors, 2), FORM, "the two others training at world size 2",
               lambda: here.tails(survivors))
    replacement = here.start(job, 1)
    now = [pods[0], replacement, pods[2]]
    eventually(lambda: here.training_on(now, 3), FORM, "the replacement pod training with them at world size 3",
               lambda: here.tails(now))
    here.finish(now)


def test_a_pytorchjob_scaled_from_min_to_max_replicas_grows_its_world(site) -> None:
    here = site(PYTORCHJOB)
    job = find(PYTORCHJOB, "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    first = [here.start(job, i) for i in range(policy["minReplicas"])]
    eventually(lambda: here.training_on(first, 2), FORM, "minReplicas pods training at world size 2",
               lambda: here.tails(first))
    grown = [*first, *(here.start(job, i) for i in range(policy["minReplicas"], policy["maxReplicas"]))]
    eventually(lambda: here.training_on(grown, 3), FORM, "maxReplicas pods training at world size 3",
               lambda: here.tails(grown))
    here.finish(grown)
