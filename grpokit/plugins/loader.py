"""`--external_plugins a.py b.py`: import each file as a top-level module, its folder on sys.path.

A plugin file ``my_plugin.py`` becomes the module ``my_plugin`` (so ``TrainerFactory.TRAINER_MAPPING['grpo'] =
'my_plugin.MyTrainer'`` resolves), and files next to it import as siblings (``from my_helpers import x``).
Importing runs the file's registrations (``orms['name'] = ...``); files load in the order given, so a later file
sees (and may replace) what an earlier one registered. Loading the same file again re-runs it.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from grpokit.errors import PluginError

logger = logging.getLogger(__name__)
_LOADED: dict[str, Path] = {}  # module name -> plugin file, for every plugin this process imported


def load_plugins(paths: list[str]) -> list[str]:
    """Import plugin files in order; returns the module names. Errors name the file and the cause."""
    names = []
    for raw in paths:
        path = Path(raw).resolve()
        if not path.is_file():
            raise PluginError(f"--external_plugins {raw}: file not found")
        if path.suffix != ".py":
            raise PluginError(f"--external_plugins {raw}: not a Python file; pass a .py file")
        name = path.stem
        _check_name_free(name, path, raw)
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - any import-time failure is the plugin's
            sys.modules.pop(name, None)
            raise PluginError(f"--external_plugins {raw}: import failed{_plugin_line(e, path)}: "
                              f"{type(e).__name__}: {_first_line(e)}") from e
        _LOADED[name] = path
        names.append(name)
    return names


def _check_name_free(name: str, path: Path, raw: str) -> None:
    """Refuse to replace an imported library module of the same name; an earlier plugin's module may be replaced."""
    current = sys.modules.get(name)
    if current is None:
        return
    origin = getattr(current, "__file__", None)
    if origin is not None and Path(origin).resolve() == path:
        return  # the same plugin loaded again: re-run it
    if _LOADED.get(name) is not None and origin is not None and Path(origin).resolve() == _LOADED[name]:
        logger.warning("plugin module %r from %s replaces the one loaded from %s", name, path, origin)
        return
    where = origin or "a built-in module"
    raise PluginError(f"--external_plugins {raw}: a module named {name!r} is already imported from {where}; "
                      "rename the plugin file")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _plugin_line(exc: BaseException, path: Path) -> str:
    """' at line N' of the deepest traceback frame inside the plugin file (or a syntax error's line)."""
    line = None
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).resolve() == path:
        line = exc.lineno
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""
