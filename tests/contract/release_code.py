"""Run a release's own deterministic-inference check on CPU: the function bodies exactly as the wheel ships them
(sglang_wheels.py), with only what they ask of the machine and the model bound to stand-ins.

- 0.5.9 - 0.5.18: `ServerArgs._handle_deterministic_inference` (server_args.py), which from 0.5.15.post1 calls the
  resolution passes of arg_groups/overrides.py;
- 0.5.19 - 0.5.23: `handle_deterministic_inference` (arg_groups/attention_hook.py) and the same passes.
Imports inside those functions are dropped and their names bound here: the GPU (is_sm100_supported, is_hip,
get_platform()), the model's architecture (get_model_config / model_config_of), the release's own backend lists, and
the resolution helpers as the trivial record SGLang's are for one writer (declare = set, view = the record).
"""

from __future__ import annotations

import ast
import copy
import logging
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from .sglang_wheels import function_node, module_lists

MONOLITHIC = ("sglang/srt/server_args.py", "_handle_deterministic_inference")
HOOK = ("sglang/srt/arg_groups/attention_hook.py", "handle_deterministic_inference")
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
PASSES = ("_deterministic_sampling_backend", "_deterministic_is_deepseek_model", "_deterministic_allreduce_fusion_disable",
          "_deterministic_rocm_rccl_check", "_deterministic_attention_backend")
MODEL_PATH = "/models/model"


@dataclass(frozen=True)
class Gpu:
    """Compute capability as SGLang's probes see it (utils/common.py is_sm100_supported: major 10; sm120: 12)."""

    major: int
    hip: bool = False


class _Drop(ast.NodeTransformer):
    """No imports and no decorators: the names are bound by the sandbox."""

    def visit_Import(self, node: ast.AST) -> ast.AST:
        return ast.Pass()

    visit_ImportFrom = visit_Import

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.decorator_list = []
        self.generic_visit(node)
        return node


class _Env:
    """SGLang's `envs.X` variables: set() is recorded, get() answers the default a test leaves alone."""

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(set=lambda value: None, get=lambda: 4)


class ServerArgs:
    """The fields the checks read; reading any other fails loudly, so a check that grows a dependency is noticed."""

    def __init__(self, architecture: str, attention_backend: str | None, tp_size: int) -> None:
        self.__dict__.update(
            model_path=MODEL_PATH, enable_deterministic_inference=True, rl_on_policy_target=None,
            attention_backend=attention_backend, prefill_attention_backend=None, decode_attention_backend=None,
            sampling_backend=None, tp_size=tp_size, disable_radix_cache=False, disable_custom_all_reduce=False,
            enable_aiter_allreduce_fusion=False, enable_flashinfer_allreduce_fusion=False,
            flashinfer_allreduce_fusion_backend=None, enable_torch_symm_mem=False,
            _architecture=architecture)

    def get_model_config(self) -> Any:
        return SimpleNamespace(hf_config=SimpleNamespace(architectures=[self._architecture]))

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the release's check reads ServerArgs.{name}, which this sandbox does not set")


def _compile(node: ast.FunctionDef, namespace: dict[str, Any]) -> Any:
    module = ast.fix_missing_locations(ast.Module(body=[_Drop().visit(copy.deepcopy(node))], type_ignores=[]))
    exec(compile(module, f"<sglang {node.name}>", "exec"), namespace)  # noqa: S102 - the release's own code
    return namespace[node.name]


@cache
def _check(version: str, gpu: Gpu) -> Any:
    return _compile(check_node(version), _namespace(version, gpu))


def _namespace(version: str, gpu: Gpu) -> dict[str, Any]:
    platform = SimpleNamespace(is_sm100=gpu.major == 10, is_sm120=gpu.major == 12, is_hip=gpu.hip,
                               is_sm100_or_sm110=gpu.major in (10, 11), has_flashinfer=True)

    def run_post_process_pass(server_args: Any, fn: Any) -> None:
        for name, value in fn(server_args).items():
            setattr(server_args, name, value)

    def declare_resolution(server_args: Any, source: str, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(server_args, name, value)

    namespace: dict[str, Any] = {
        **module_lists(version), "Any": Any, "logger": logging.getLogger(f"sglang-{version}"),
        "os": SimpleNamespace(environ={}), "envs": _Env(),
        "ConnectorType": SimpleNamespace(INSTANCE="instance"), "parse_connector_type": lambda path: "local",
        "is_sm100_supported": lambda: platform.is_sm100, "is_sm120_supported": lambda: platform.is_sm120,
        "is_sm100_or_sm110_supported": lambda: platform.is_sm100_or_sm110, "is_hip": lambda: gpu.hip,
        "get_platform": lambda: platform, "model_config_of": lambda args: args.get_model_config(),
        "resolved_view": lambda args: args, "resolving_view": lambda args: args,
        "run_post_process_pass": run_post_process_pass, "declare_resolution": declare_resolution,
    }
    for name in PASSES:
        node = function_node(version, OVERRIDES, name)
        if node is not None:
            _compile(node, namespace)
    return namespace


def check_node(version: str) -> ast.FunctionDef:
    node = function_node(version, *HOOK) or function_node(version, *MONOLITHIC)
    assert node is not None, f"SGLang {version}: no deterministic-inference check found"
    return node


def run_deterministic_check(version: str, gpu: Gpu, architecture: str, attention_backend: str | None,
                            tp_size: int = 8) -> ServerArgs:
    """The server args after the release's check, which raises ValueError where SGLang refuses to start."""
    args = ServerArgs(architecture, attention_backend, tp_size)
    _check(version, gpu)(args)
    return args
