"""Unknown-field checking as `kubectl apply --validate=strict` does it for a CRD.

jsonschema alone accepts any extra property (a CRD's openAPIV3Schema never says
`additionalProperties: false`), but the API server prunes or, with strict validation,
rejects every field the structural schema does not declare. This walks a document beside
its schema and names each such field; type checks stay with jsonschema.
"""

from __future__ import annotations

from typing import Any

# Kubernetes validates a resource's own metadata as ObjectMeta, not by the CRD's schema.
OBJECT_META = {
    "name",
    "namespace",
    "generateName",
    "labels",
    "annotations",
    "finalizers",
    "ownerReferences",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
}
PRESERVE = "x-kubernetes-preserve-unknown-fields"


def unknown_fields(doc: Any, schema: dict, path: str = "") -> list[str]:
    """JSON paths of the fields in ``doc`` that ``schema`` does not declare."""
    if path == "" and isinstance(doc, dict) and isinstance(doc.get("metadata"), dict):
        bad = [f"/metadata/{k}" for k in doc["metadata"] if k not in OBJECT_META]
        rest = {k: v for k, v in doc.items() if k != "metadata"}
        return bad + unknown_fields(rest, {**schema, "properties": _without_meta(schema)}, "/")
    if schema.get(PRESERVE) or schema.get("x-kubernetes-int-or-string"):
        return []
    if isinstance(doc, list):
        items = schema.get("items", {})
        return [p for i, v in enumerate(doc) for p in unknown_fields(v, items, f"{path}/{i}")]
    if not isinstance(doc, dict):
        return []
    return _object_fields(doc, schema, path)


def _without_meta(schema: dict) -> dict:
    return {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}


def _object_fields(doc: dict, schema: dict, path: str) -> list[str]:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    bad = []
    for key, value in doc.items():
        where = f"{path.rstrip('/')}/{key}"
        if key in props:
            bad += unknown_fields(value, props[key], where)
        elif isinstance(extra, dict):  # a map: every value follows one schema
            bad += unknown_fields(value, extra, where)
        elif extra is not True:
            bad.append(where)
    return bad
