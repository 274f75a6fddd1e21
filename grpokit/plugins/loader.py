"""`--external_plugins a.py b.py`: import each file as a top-level module, its folder on sys.path.

A plugin file ``my_plugin.py`` becomes the module ``my_plugin`` (so ``TrainerFactory.TRAINER_MAPPING['grpo'] =
'my_plugin.MyTrainer'`` resolves), and files next to it import as siblings (``from my_helpers import x``).
Importing runs the file's registrations (``orms['name'] = ...``); files load in the order given, so a later file
sees (and may replace) what an earlier one registered. Loading the same file again re-runs it
(``load_plugins_once`` skips files already imported).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

from grpokit.config.checks import provide
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
            raise PluginError(
                f"--external_plugins {raw}: import failed{_plugin_line(e, path)}: {type(e).__name__}: {_first_line(e)}"
            ) from e
        _LOADED[name] = path
        names.append(name)
    return names


def load_plugins_once(paths: list[str]) -> list[str]:
    """``load_plugins`` for the files this process has not imported yet. ``grpokit train`` imports the plugins
    while it checks the options (their registrations add names that options select) and the pipeline asks for
    them again before it builds the run: the second request must not re-run the registrations."""
    todo = [raw for raw in paths if not _already_loaded(Path(raw).resolve())]
    load_plugins(todo)
    return [Path(raw).resolve().stem for raw in paths]


provide("load_plugins", load_plugins_once)  # `grpokit train --external_plugins p.py --help` (config/parse.py)


def _already_loaded(path: Path) -> bool:
    """The file's module is still the one imported from it (tests may remove plugin modules to undo a load)."""
    module = sys.modules.get(path.stem)
    origin = getattr(module, "__file__", None)
    return _LOADED.get(path.stem) == path and origin is not None and Path(origin).resolve() == path


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
    raise PluginError(
        f"--external_plugins {raw}: a module named {name!r} is already imported from {where}; rename the plugin file"
    )


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
