"""An offline schema check of Kubernetes manifests against the API clients' models, stricter than the clients.

The ``kubernetes`` Python client's models (``kubernetes.client.models``: ``V1Service``, ``V1StatefulSet``,
``V1Job``, ...) and the Kubeflow training SDK's (PyPI ``kubeflow-training``, generated from the training
operator's OpenAPI spec: ``KubeflowOrgV1PyTorchJob``, ``KubeflowOrgV1ElasticPolicy``, ...) describe each object:
``attribute_map`` (Python attribute -> JSON field name) and ``openapi_types`` (attribute -> type: ``str``,
``int``, ``bool``, ``object``, ``list[T]``, ``dict(str, T)``, ``datetime`` or another model's name). Their own
deserializer ignores a field it does not know, so a misspelled field (``minReplica``) would pass silently --
as the API server itself prunes unknown fields of a custom resource. :func:`problems` therefore walks the
object against the models and reports every field that is not in the model's ``attribute_map`` and every
value of the wrong JSON type; then :func:`check` deserializes the object with the client's own deserializer,
which runs the models' setters (required fields, enum values where the model declares them).

Kinds: ``Service``, ``StatefulSet``, ``Job`` (the ``kubernetes`` client) and ``PyTorchJob`` (``kubeflow-training``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

__all__ = ["MODELS", "problems", "check", "ManifestError"]

#: kind -> (apiVersion, model class name, the package that defines it)
MODELS = {
    "Service": ("v1", "V1Service", "kubernetes"),
    "StatefulSet": ("apps/v1", "V1StatefulSet", "kubernetes"),
    "Job": ("batch/v1", "V1Job", "kubernetes"),
    "PyTorchJob": ("kubeflow.org/v1", "KubeflowOrgV1PyTorchJob", "kubeflow"),
}


class ManifestError(ValueError):
    """A manifest object that does not match its schema; ``problems`` lists what (one string each)."""

    def __init__(self, kind: str, name: str, found: list[str]) -> None:
        super().__init__(f"{kind} {name}: " + "; ".join(found))
        self.problems = found


def _models(package: str) -> Any:
    if package == "kubeflow":
        import kubeflow.training.models as kubeflow_models

        return kubeflow_models
    import kubernetes.client.models as k8s_models

    return k8s_models


def _walk(value: Any, type_name: str, path: str, models: Any, found: list[str]) -> None:
    """Append to ``found`` what in ``value`` (at ``path``) does not fit the OpenAPI type ``type_name``."""
    if type_name == "object":  # IntOrString, free-form: anything goes
        return
    if m := re.fullmatch(r"list\[(.*)\]", type_name):
        if not isinstance(value, list):
            found.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            _walk(item, m.group(1), f"{path}[{i}]", models, found)
        return
    if m := re.fullmatch(r"dict\(str, (.*)\)", type_name):
        if not isinstance(value, dict):
            found.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return
        for key, item in value.items():
            _walk(item, m.group(1), f"{path}.{key}", models, found)
        return
    natives = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "datetime": (str,),
               "date": (str,)}
    if type_name in natives:
        ok = isinstance(value, natives[type_name]) and not (type_name != "bool" and isinstance(value, bool))
        if not ok:
            found.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    model = getattr(models, type_name, None)
    if model is None:
        found.append(f"{path}: unknown model {type_name}")
        return
    if not isinstance(value, dict):
        found.append(f"{path}: expected an object ({type_name}), got {type(value).__name__}")
        return
    by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json:
            found.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        _walk(item, model.openapi_types[by_json[key]], f"{path}.{key}", models, found)


def problems(obj: Mapping[str, Any]) -> list[str]:
    """Every unknown field and wrongly typed value of ``obj`` (a manifest object), as ``"PATH: what"``.

    Raises:
        ValueError: a kind not in :data:`MODELS`.
    """
    kind = obj.get("kind")
    if kind not in MODELS:
        raise ValueError(f"no schema for kind {kind!r} here (known: {sorted(MODELS)})")
    api_version, model_name, package = MODELS[kind]
    found = [] if obj.get("apiVersion") == api_version else [
        f"apiVersion: {obj.get('apiVersion')!r}, expected {api_version!r} for {kind}"]
    _walk(dict(obj), model_name, kind, _models(package), found)
    return found


def check(obj: Mapping[str, Any]) -> Any:
    """``obj`` deserialized into its client model, after :func:`problems` found nothing.

    Raises:
        ManifestError: :func:`problems` found something, or the model's own checks failed (e.g. a required
            field missing: the client's ``ValueError``).
    """
    kind, name = str(obj.get("kind")), str((obj.get("metadata") or {}).get("name"))
    found = problems(obj)
    if found:
        raise ManifestError(kind, name, found)
    _, model_name, package = MODELS[kind]
    if package == "kubeflow":
        from kubeflow.training import ApiClient as KubeflowApiClient

        client: Any = KubeflowApiClient()
    else:
        from kubernetes.client import ApiClient

        client = ApiClient()
    try:
        return client._ApiClient__deserialize(dict(obj), model_name)  # the client's own deserializer
    except ValueError as exc:
        raise ManifestError(kind, name, [str(exc)]) from None
