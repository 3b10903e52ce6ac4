"""The DatasetGeneration CRD, generated from the pydantic spec and status models.

pydantic's JSON schema is turned into a Kubernetes structural schema (refs inlined, no anyOf/null, int-or-string
for `auto` fields), then CEL rules are attached for what a schema cannot say. `python -m
tokenmill_operator.crd` rewrites crds/; a test fails when the committed file is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from tokenmill_runner.facts.releases import MOVING_TAG_PATTERN, RELEASES
from tokenmill_runner.spec.resource import API_VERSION, KV_CACHE_DTYPES, MANAGED_FLAGS, DatasetGenerationSpec

from .decide.status import DatasetGenerationStatus

GROUP, VERSION = API_VERSION.split("/")
PLURAL, SINGULAR, KIND = "datasetgenerations", "datasetgeneration", "DatasetGeneration"
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / f"{PLURAL}.{GROUP}.yaml"

KEEP = ("type", "description", "default", "nullable", "minimum", "maximum", "minLength", "maxLength", "pattern", "enum",
        "minItems", "maxItems", "format")
Path_ = tuple[str, ...]


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = dict(defs[node["$ref"].rsplit("/", 1)[-1]])
        # The field's own description and default win over the referenced model's.
        target.update({key: node[key] for key in ("description", "default") if key in node})
        return target
    return node


def _merge_any_of(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    options = [_resolve(o, defs) for o in node["anyOf"] if o.get("type") != "null"]
    types = {o.get("type") for o in options}
    base = {k: v for k, v in node.items() if k != "anyOf"}
    if len(options) < len(node["anyOf"]) and base.get("default") is not None:
        # An explicit null must survive: Kubernetes prunes non-nullable nulls and would re-apply the default.
        base["nullable"] = True
    if len(options) == 1:
        return {**options[0], **base}
    if types == {"integer", "string"}:
        # `N | "auto"`: Kubernetes' int-or-string, checked by a CEL rule; the number's bounds apply to numbers only
        # (without them `replicas: -1` passed kubectl apply and failed in the operator).
        number = next(o for o in options if o.get("type") == "integer")
        bounds: dict[str, Any] = {key: number[key] for key in ("minimum", "maximum") if key in number}
        return {**base, **bounds, "x-kubernetes-int-or-string": True, "x-kubernetes-validations": [
            {"rule": "type(self) == int || self == 'auto'", "message": "must be an integer or \"auto\""}]}
    if types == {"string"}:
        return {**base, "type": "string"}
    raise ValueError(f"cannot express {node} in a structural schema")


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """pydantic JSON schema node → structural OpenAPI v3 schema node."""
    node = _resolve(node, defs)
    if "anyOf" in node:
        node = _merge_any_of(node, defs)
    out: dict[str, Any] = {k: node[k] for k in KEEP if k in node}
    for key in ("x-kubernetes-int-or-string", "x-kubernetes-validations"):
        if key in node:
            out[key] = node[key]
    if out.get("default", 0) is None:
        del out["default"]
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"] + (1 if node.get("type") == "integer" else 0)
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"] - (1 if node.get("type") == "integer" else 0)
    if "properties" in node:
        out["properties"] = {name: structural(child, defs) for name, child in node["properties"].items()}
        required = node.get("required") or []
        if required:
            out["required"] = list(required)
        for name, child in out["properties"].items():
            # Kubernetes applies nested defaults only inside objects that exist: default optional objects to {}. Not
            # an object whose absence means off (a None default, e.g. hiddenStates): {} would switch it on.
            off_when_unset = node["properties"][name].get("default", 0) is None
            if child.get("type") == "object" and "properties" in child and name not in required \
                    and not child.get("required") and not off_when_unset:
                child.setdefault("default", {})
    if "items" in node:
        out["items"] = structural(node["items"], defs)
    extra = node.get("additionalProperties")
    if extra is True or (node.get("type") == "object" and not node.get("properties") and extra is None):
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs)
    return out


def _schema_of(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    return structural(schema, schema.get("$defs", {}))


def _at(schema: dict[str, Any], path: Path_) -> dict[str, Any]:
    node = schema
    for part in path:
        node = node["items"] if part == "[]" else node["properties"][part]
    return node


def _rule(rule: str, message: str, reason: str | None = None, field_path: str | None = None) -> dict[str, str]:
    validation = {"rule": rule, "message": message}
    if reason:
        validation["reason"] = reason
    if field_path:
        validation["fieldPath"] = field_path
    return validation


# A Hugging Face repository id: [org/]name, letters, digits, '.', '_', '-' (never '..', never a leading '/').
HUB_ID = "^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9_-])?(/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9_-])?)?$"
FRACTION_RULE = "self.matches('^[0-9]*[.]?[0-9]+$') && double(self) > 0.0 && double(self) < 1.0"
DECIMAL_RULE = "self.matches('^-?[0-9]*[.]?[0-9]+$')"

# Bounds keep CEL's cost estimate finite; the numbers are far above any real run.
BOUNDS: dict[Path_, dict[str, Any]] = {
    ("datasets",): {"maxItems": 64},
    ("datasets", "[]", "name"): {"maxLength": 63, "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"},
    ("datasets", "[]", "source"): {"maxLength": 2048},
    **{("datasets", "[]", "input", "fields", column): {"minLength": 1, "maxLength": 256}
       for column in ("messages", "prompt", "system", "id", "tools")},
    ("model", "path"): {"maxLength": 2048, "minLength": 1},
    ("model", "tokenizer"): {"maxLength": 2048},
    ("output", "uri"): {"maxLength": 2048},
    ("server", "extraArgs"): {"maxItems": 128},
    ("server", "extraArgs", "[]"): {"maxLength": 4096},
    ("sampling", "stopTokenIds"): {"maxItems": 64},
    ("datasets", "[]", "sampling", "stopTokenIds"): {"maxItems": 64},
    ("output", "credentialsSecret"): {"maxLength": 253, "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
    ("output", "endpoint"): {"maxLength": 2048, "pattern": "^https?://"},
}


def _tokenizer(obj: str) -> str:
    return f"(has({obj}.spec.model.tokenizer) ? {obj}.spec.model.tokenizer : {obj}.spec.model.path)"


_STARTED = "!has(oldSelf.status) || !has(oldSelf.status.run) || "
# On the whole object, because only there can a rule see the status: once the operator recorded what the run
# started with (status.run, set with the first runner Job), what its outputs belong to cannot change. A status
# update leaves the spec as it was, so these never refuse the operator's own writes.
ROOT_RULES = [
    _rule(_STARTED + "self.spec.model.path == oldSelf.spec.model.path",
          "spec.model.path cannot change once the run has started (status.run): outputs of two models would mix "
          "under one output URI; create a new DatasetGeneration for the new model", "FieldValueForbidden",
          ".spec.model.path"),
    _rule(_STARTED + "(!has(self.spec.model.tokenizer) && !has(oldSelf.spec.model.tokenizer)) || "
          + _tokenizer("self") + " == " + _tokenizer("oldSelf"),
          "spec.model.tokenizer cannot change once the run has started (status.run): prompts tokenized two ways "
          "would mix; create a new DatasetGeneration", "FieldValueForbidden", ".spec.model.tokenizer"),
    _rule(_STARTED + "oldSelf.spec.datasets.all(o, self.spec.datasets.all(n, n.name != o.name || "
          "(n.source == o.source && (has(n.input) == has(o.input)) && (!has(n.input) || n.input == o.input))))",
          "spec.datasets[].source and .input cannot change once the run has started (status.run): committed samples "
          "are keyed by source line, so another file or another column mapping would silently re-map them onto "
          "other prompts; add the new source as a dataset of its own name, or create a new DatasetGeneration "
          "(samples and limit may change)",
          "FieldValueForbidden", ".spec.datasets"),
    _rule(_STARTED + "self.spec.output.uri == oldSelf.spec.output.uri",
          "spec.output.uri cannot change once the run has started (status.run): the runner resumes from what is "
          "committed there; create a new DatasetGeneration to start over elsewhere", "FieldValueForbidden",
          ".spec.output.uri"),
]

RULES: dict[Path_, list[dict[str, str]]] = {
    (): [
        _rule("!has(self.server) || !has(self.server.contextLength) || type(self.server.contextLength) != int || "
              "self.datasets.all(d, !has(d.sampling) || "
              "!has(d.sampling.maxNewTokens) || d.sampling.maxNewTokens < self.server.contextLength)",
              "every dataset's sampling.maxNewTokens must be below server.contextLength (the prompt needs room too)",
              "FieldValueInvalid", ".datasets"),
        _rule("!has(self.sampling) || !has(self.sampling.maxNewTokens) || !has(self.server) || "
              "!has(self.server.contextLength) || type(self.server.contextLength) != int || "
              "self.sampling.maxNewTokens < self.server.contextLength",
              "sampling.maxNewTokens must be below server.contextLength (the prompt needs room too)",
              "FieldValueInvalid", ".sampling.maxNewTokens"),
    ],
    ("datasets",): [_rule("self.all(d, self.exists_one(e, e.name == d.name))",
                          "dataset names must be unique (each names an output folder)")],
    ("datasets", "[]", "source"): [_rule("self.startsWith('s3://')",
                                         "in a cluster, sources are read from S3: use s3://bucket/key.jsonl "
                                         "(local files work only with `tokenmill run`)")],
    ("output", "uri"): [_rule("self.matches('^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$')",
                              "output.uri must be s3://bucket/prefix/ (a local folder works only with "
                              "`tokenmill run`)"),
                        # spec/resource.py S3_PREFIX_ESCAPE, in RE2.
                        _rule("!self.matches('/[.][.]?(/|$)') && !self.matches('%2[fFeE]') && "
                              "!self.contains('\\\\') && !self.matches('[^:/]//')",
                              "output.uri must not hold '.' or '..' segments, an empty segment ('//') or an encoded "
                              "slash or dot (%2F, %2E): a store or proxy that normalises keys would write outside "
                              "the prefix")],
    # In a cluster the model is on S3, a PVC or the Hugging Face hub: a local path would name a folder of the
    # operator's own filesystem (model_files.model_files_location never looks at one).
    **{("model", field): [_rule("self.startsWith('s3://') || self.startsWith('pvc://') || "
                                "self.matches('" + HUB_ID + "')",
                                f"spec.model.{field} must be s3://bucket/prefix/, pvc://claim/path or a Hugging Face "
                                "id (org/name); a local folder works only with `tokenmill run`")]
       for field in ("path", "tokenizer")},
    ("server",): [
        _rule("!has(self.tensorParallel) || type(self.tensorParallel) != int || "
              "self.tensorParallel in [1, 2, 4, 8, 16, 32, 64]",
              "server.tensorParallel must be a power of two (1-64) or \"auto\"", "FieldValueInvalid",
              ".tensorParallel"),
        _rule("!has(self.tensorParallel) || !has(self.gpusPerNode) || type(self.tensorParallel) != int || "
              "self.tensorParallel <= self.gpusPerNode || self.tensorParallel % self.gpusPerNode == 0",
              "server.tensorParallel above gpusPerNode must span whole nodes (a multiple of gpusPerNode)",
              "FieldValueInvalid", ".tensorParallel"),
        # An abbreviation is a prefix: refused like the flag (spec/resource.py MANAGED_FLAGS says why).
        _rule("!has(self.extraArgs) || self.extraArgs.all(a, !a.startsWith('--') || !("
              + str(list(MANAGED_FLAGS)).replace('"', "'") + ".exists(f, f.startsWith(a.split('=')[0]))))",
              "server.extraArgs must not set flags the operator manages, nor abbreviate one (model path, host, "
              "port, tensor parallel, API keys, multi-node, --trust-remote-code, --config): use the spec fields "
              "instead", "FieldValueForbidden", ".extraArgs"),
    ],
    ("server", "memFractionStatic"): [_rule("self == 'auto' || (" + FRACTION_RULE + ")",
                                            "must be \"auto\" or a fraction between 0 and 1 as a string, e.g. \"0.85\"")],
    ("validation", "maxTruncatedFraction"): [_rule(FRACTION_RULE, "must be a fraction between 0 and 1, e.g. \"0.05\"")],
    ("validation", "minReasoningFraction"): [_rule(FRACTION_RULE, "must be a fraction between 0 and 1, e.g. \"0.9\"")],
    ("validation", "maxErrorFraction"): [_rule(FRACTION_RULE, "must be a fraction between 0 and 1, e.g. \"0.01\"")],
}
# The ranges SGLang's SamplingParams.verify accepts (the runner's spec/resource.py says where they come from); outside them every
# request of the dataset would be answered HTTP 400.
SAMPLING_RANGES = {
    "temperature": ("double(self) >= 0.0", "must be a number >= 0 as a string, e.g. \"0.6\""),
    "topP": ("double(self) > 0.0 && double(self) <= 1.0", "must be in (0, 1] as a string, e.g. \"0.95\""),
    "minP": ("double(self) >= 0.0 && double(self) <= 1.0", "must be in [0, 1] as a string, e.g. \"0.05\""),
    "repetitionPenalty": ("double(self) > 0.0 && double(self) <= 2.0",
                          "must be in (0, 2] as a string (1.0 = no penalty)"),
}
for _prefix in (("sampling",), ("datasets", "[]", "sampling")):
    for _name, (_range, _message) in SAMPLING_RANGES.items():
        RULES[(*_prefix, _name)] = [
            _rule(DECIMAL_RULE, "must be a decimal number written as a string, e.g. \"0.6\""),
            _rule("!self.matches('" + DECIMAL_RULE.split("'")[1] + "') || (" + _range + ")",
                  f"{_message}: SGLang refuses other values with HTTP 400"),
        ]
        BOUNDS[(*_prefix, _name)] = {"maxLength": 32}
    RULES[(*_prefix, "topK")] = [_rule("self == -1 || self >= 1", "must be -1 (the whole vocabulary) or at least 1: "
                                       "SGLang refuses other values with HTTP 400")]
for _path in (("server", "memFractionStatic"), ("validation", "maxTruncatedFraction"),
              ("validation", "minReasoningFraction"), ("validation", "maxErrorFraction")):
    BOUNDS[_path] = {"maxLength": 32}




def _release_pattern(versions: list[str], in_tag: bool) -> str:
    alternatives = "|".join(v.replace(".", "[.]") for v in versions)
    return f":v?({alternatives})(-[A-Za-z0-9._-]+)?$" if in_tag else f"^v?({alternatives})$"


def kv_cache_dtype_rules() -> list[dict[str, str]]:
    """One rule per --kv-cache-dtype value some known release refuses: refused when spec.server.sglangVersion, else
    the image tag, names such a release (the argument parser would exit and the pod restart forever). The planner
    checks the same for releases this list does not name."""
    rules = []
    for dtype in KV_CACHE_DTYPES:
        refusing = [v for v, r in RELEASES.items() if dtype not in r.kv_cache_dtypes]
        if not refusing:
            continue
        version = _release_pattern(refusing, in_tag=False)
        tag = _release_pattern(refusing, in_tag=True)
        rules.append(_rule(
            f"!has(self.kvCacheDtype) || self.kvCacheDtype != '{dtype}' || !(has(self.sglangVersion) ? "
            f"self.sglangVersion.matches('{version}') : (has(self.image) && self.image.matches('{tag}')))",
            f"server.kvCacheDtype {dtype} is refused by the SGLang release of server.sglangVersion or the image tag "
            f"(SGLang {', '.join(refusing)} do not accept it)", "FieldValueInvalid", ".kvCacheDtype"))
    return rules


RULES[("server",)] += [
    *kv_cache_dtype_rules(),
    _rule(f"has(self.sglangVersion) || !has(self.image) || !self.image.matches('{MOVING_TAG_PATTERN}')",
          "server.image has a tag SGLang moves to each new build (latest, nightly, dev): pin a release tag (e.g. "
          "lmsysorg/sglang:v0.5.23) or set server.sglangVersion to the release it runs", "FieldValueRequired",
          ".sglangVersion"),
    _rule("!has(self.attentionDataParallel) || type(self.attentionDataParallel) != int || "
          "(has(self.tensorParallel) && type(self.tensorParallel) == int ? "
          "self.tensorParallel % self.attentionDataParallel == 0 : self.attentionDataParallel in [1, 2, 4, 8, 16, 32, 64])",
          "server.attentionDataParallel must divide tensorParallel (SGLang asserts tp % dp == 0)", "FieldValueInvalid",
          ".attentionDataParallel"),
]
BOUNDS[("server", "image")] = {"maxLength": 512}
BOUNDS[("server", "sglangVersion")] = {"maxLength": 32, "pattern": "^v?[0-9]+[.][0-9]+[.][0-9]+([.]post[0-9]+)?$"}


def spec_schema() -> dict[str, Any]:
    schema = _schema_of(DatasetGenerationSpec)
    for path, bounds in BOUNDS.items():
        _at(schema, path).update(bounds)
    for path, rules in RULES.items():
        node = _at(schema, path)
        node["x-kubernetes-validations"] = node.get("x-kubernetes-validations", []) + rules
    return schema


def status_schema() -> dict[str, Any]:
    schema = _schema_of(DatasetGenerationStatus)
    conditions = _at(schema, ("conditions",))
    conditions.update({"maxItems": 16, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    return schema


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Display-only phase."},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.display",
     "description": "Committed and failed samples of the total."},
    {"name": "Tokens/s", "type": "integer", "jsonPath": ".status.progress.tokensPerSecond",
     "description": "Committed output tokens per second."},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta", "description": "Time left."},
    {"name": "Predicted", "type": "integer", "jsonPath": ".status.serverPlan.prediction.outputTokensPerSecond",
     "priority": 1, "description": "Output tokens/s the server plan predicts for the job (compare Tokens/s)."},
    {"name": "Verdict", "type": "string", "jsonPath": ".status.report.verdict", "priority": 1,
     "description": "The validation report's verdict."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "tokenmill"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": ["dsgen"],
                      "categories": ["tokenmill"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "x-kubernetes-validations": ROOT_RULES,
                    "description": "DatasetGeneration mills prompt datasets into token-exact outputs of a model "
                                   "served by SGLang, with shards, commit markers and a validation report in S3.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string", "description": "tokenmill.io/v1alpha1"},
                        "kind": {"type": "string", "description": "DatasetGeneration"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def render() -> str:
    header = "# Generated by `python -m tokenmill_operator.crd` from the pydantic models; do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main() -> int:
    CRD_FILE.parent.mkdir(parents=True, exist_ok=True)
    CRD_FILE.write_text(render())
    sys.stdout.write(f"wrote {CRD_FILE}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
