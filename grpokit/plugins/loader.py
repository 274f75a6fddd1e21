"""`--external_plugins a.py b.py`: import each file as a top-level module, its folder on sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from grpokit.errors import PluginError


def load_plugins(paths: list[str]) -> list[str]:
    """Import plugin files in order; returns the module names. Errors name the file and the cause."""
    names = []
    for raw in paths:
        path = Path(raw).resolve()
        if not path.is_file():
            raise PluginError(f"--external_plugins {raw}: file not found")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = path.stem
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any import-time failure is the plugin's
            sys.modules.pop(name, None)
            line = _plugin_line(e, path)
            raise PluginError(f"--external_plugins {raw}: import failed{line}: {type(e).__name__}: {e}") from e
        names.append(name)
    return names


def _plugin_line(exc: BaseException, path: Path) -> str:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""
