"""Reward sources of type function: `fn(prompts, completions, labels) -> one number per completion`.

The entrypoint is `module:function` (imported from the image's Python path) or
`path/file.py:function`, a file read from the source's ConfigMap mount
(REWARD_FUNCTIONS_DIR/<source name>/) when configMap is set, else from the job file's directory.
Either way that directory goes on the import path, so the file may import its neighbours.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlhf_api.contract import REWARD_FUNCTIONS_DIR
from rlhf_api.v1alpha1 import RewardSource

from ..paths import local_path

if TYPE_CHECKING:
    from . import SourceContext

FUNCTIONS_DIR = Path(REWARD_FUNCTIONS_DIR)


def _on_import_path(directory: Path) -> None:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


def _load_file(path: Path, module_name: str):
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: fix function.entrypoint (or the ConfigMap's keys)")
    _on_import_path(path.parent)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so the module's own classes pickle (Ray) and dataclasses resolve
    spec.loader.exec_module(module)
    return module


def function_source(source: RewardSource, context: SourceContext) -> Callable:
    """The callable named by source.function.entrypoint."""
    target, name = source.function.entrypoint.rsplit(":", 1)
    root = FUNCTIONS_DIR / source.name if source.function.config_map else context.base_dir
    if target.endswith(".py"):
        module = _load_file(local_path(target, root), f"rlhf_reward_{source.name.replace('-', '_')}")
    else:
        if source.function.config_map:
            _on_import_path(root)
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{module.__name__} ({module.__file__}) has no function {name!r}: fix function.entrypoint")
    return function

