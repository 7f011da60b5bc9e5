"""Reward sources of type function: `fn(prompts, completions, labels) -> one number per completion`.

The entrypoint is `module:function` (imported from the image's Python path) or
`path/file.py:function`, a file read from the source's ConfigMap mount
(REWARD_FUNCTIONS_DIR/<source name>/) when configMap is set, else from the job file's directory.
Either way that directory goes on the import path, so the file may import its neighbours.
The function is called with three positional arguments (CALL); `function_source` checks its
signature when the reward is built, and `rlhf run` builds it once before Ray starts (checks.py).
"""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rlhf_api.contract import REWARD_FUNCTIONS_DIR
from rlhf_api.paths import local_path
from rlhf_api.v1alpha1 import RewardSource

if TYPE_CHECKING:
    from . import SourceContext

FUNCTIONS_DIR = Path(REWARD_FUNCTIONS_DIR)
CALL = ("prompts", "completions", "labels")  # how rewards.Reward.score calls every scorer


def _on_import_path(directory: Path) -> None:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


def _load_file(path: Path, module_name: str, config_map: str | None):
    if not path.is_file():
        where = (f"the ConfigMap {config_map!r} is mounted at {path.parent} in the cluster: "
                 "check its keys, or remove configMap to read the file next to the job file"
                 if config_map else "relative paths start at the job file's directory")
        raise FileNotFoundError(f"{path} does not exist ({where}): fix function.entrypoint")
    _on_import_path(path.parent)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so the module's own classes pickle (Ray) and dataclasses resolve
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # no half-run module for a later import to find
        raise
    return module


def load_entrypoint(entrypoint: str, root: Path, config_map: str | None, module_name: str) -> tuple[Any, Any]:
    """(module, attribute) that `module:name` or `file.py:name` names: a module of the image, or a
    file under root (the mount of `config_map` when set, else the job file's directory), whose
    directory goes on the import path. Function rewards and environment classes load this way."""
    target, name = entrypoint.rsplit(":", 1)
    if target.endswith(".py"):
        module = _load_file(local_path(target, root), module_name, config_map)
    else:
        if config_map:
            _on_import_path(root)
        module = importlib.import_module(target)
    return module, getattr(module, name, None)


def function_source(source: RewardSource, context: SourceContext) -> Callable:
    """The callable named by source.function.entrypoint."""
    config_map = source.function.config_map
    root = FUNCTIONS_DIR / source.name if config_map else context.base_dir
    module, function = load_entrypoint(source.function.entrypoint, root, config_map,
                                       f"rlhf_reward_{source.name.replace('-', '_')}")
    if not callable(function):
        name = source.function.entrypoint.rsplit(":", 1)[1]
        raise AttributeError(f"{module.__name__} ({module.__file__}) has no function {name!r}: fix function.entrypoint")
    check_signature(function, source.function.entrypoint)
    return function


def check_signature(function: Callable, entrypoint: str) -> None:
    """Refuse a function the trainer cannot call as function(prompts, completions, labels)."""
    call = f"({', '.join(CALL)})"
    if inspect.iscoroutinefunction(function):
        raise TypeError(f"{entrypoint} is async, but it is called as a plain function{call}: make it a def")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the first call will tell
    try:
        signature.bind(*CALL)
    except TypeError as error:
        raise TypeError(f"{entrypoint} takes {signature} but is called with three positional arguments {call} "
                        f"({error}): give it parameters {call}") from None

