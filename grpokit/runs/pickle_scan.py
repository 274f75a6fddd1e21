"""Every pickle in a checkpoint checked without unpickling it, before any loader reads the checkpoint; and, after
a load failed, the files that are not whole (``unreadable_parts``), found the same way.

accelerate reads its files with ``torch.load(weights_only=True)``, but a resume with ``--deepspeed`` hands the
folder to DeepSpeed (``torch.load(weights_only=False)``) and one with ``--fsdp`` to ``torch.distributed.checkpoint``
(``pickle.load`` of its ``.metadata``). A pickle runs code only through the callables it names (``GLOBAL``,
``STACK_GLOBAL``, ``INST``, the copyreg extension codes), so each pickle (a raw one, or those inside a torch zip
file) is walked opcode by opcode with ``pickletools`` (which never executes anything), the names it would import
are collected, and any name outside ``allowed`` refuses the resume with one line naming the file and the name.
The same bytes then load the same way under any loader: nothing but tensors, storages, plain containers, numpy
arrays and the dataclasses and enums of torch's checkpoint metadata and of DeepSpeed can be built.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import pickletools
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from grpokit.errors import ConfigError
from grpokit.runs.checkpoint_files import NotData, first_line, open_regular

_MARK = object()
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_NAMES = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),  # the type _rebuild_from_type_v2 rebuilds a plain tensor as (ZeRO-3's optimizer states)
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.serialization", "_get_layout"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
}
# modules whose dataclasses and enums a checkpoint may hold (only when the module is already imported: a name in
# a pickle never imports anything here)
_RECORD_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.", "deepspeed.")
MAX_MEMBERS = 64  # pickles in one torch zip file
MAX_PICKLES = 8  # pickles in a row in one file (torch's legacy format writes five)
_TEXT = (".safetensors", ".json", ".txt", ".jinja", ".py", ".md", ".model", ".tiktoken")  # never unpickled


def allowed(module: str, name: str) -> bool:
    """Whether a checkpoint's pickle may name ``module.name`` (see the module docstring)."""
    if (module, name) in _NAMES:
        return True
    if module == "torch._utils":
        return name.startswith("_rebuild_")
    if module == "torch":  # storages, dtypes, memory formats, layouts: values, not code
        torch = sys.modules.get("torch")
        value = getattr(torch, name, None) if torch is not None else None
        kinds = tuple(getattr(torch, k) for k in ("dtype", "memory_format", "layout") if hasattr(torch, k))
        return name.endswith("Storage") or (bool(kinds) and isinstance(value, kinds))
    if module == "numpy.dtypes":
        return name.endswith("DType")
    if module.startswith(_RECORD_MODULES) and module in sys.modules:
        value = getattr(sys.modules[module], name, None)
        return inspect.isclass(value) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    return False


def pickle_names(data: bytes) -> Iterator[tuple[str, str]]:
    """(module, name) of every callable the pickle ``data`` would import, read without executing it; a name the
    walk cannot tell (a ``STACK_GLOBAL`` over values that are not plain strings) is ``("?", "?")``."""
    stack: list = []
    memo: dict = {}
    for op, arg, _ in _ops(data):
        kind = op.name
        if kind in ("GLOBAL", "INST"):
            module, _, name = str(arg).partition(" ")
            yield module, name
        elif kind.startswith("EXT"):
            yield "copyreg extension", str(arg)
        if kind == "STACK_GLOBAL":
            name, module = (stack.pop() if stack else None), (stack.pop() if stack else None)
            yield (module, name) if isinstance(module, str) and isinstance(name, str) else ("?", "?")
            stack.append(None)
        elif kind == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif kind in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1] if stack else None
        elif kind in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg))
        else:
            _apply(op, arg, stack)


def _ops(data: bytes, most: int = MAX_PICKLES) -> Iterator[tuple]:
    """The opcodes of the pickles at the start of ``data``, one after another (up to ``most``); stops at the first
    bytes that do not parse (the raw storages of torch's legacy format, or a file that is no pickle at all)."""
    offset = 0
    for _ in range(most):
        if offset >= len(data):
            return
        end = None
        for op, arg, pos in pickletools.genops(data[offset:]):
            yield op, arg, pos
            if op.name == "STOP":
                end = offset + pos + 1
        if end is None:
            return
        offset = end


def _apply(op, arg, stack: list) -> None:
    """The opcode's effect on the stack, values unknown (None) except strings and marks."""
    before = op.stack_before
    if pickletools.stackslice in before:
        while stack and stack[-1] is not _MARK:
            stack.pop()
        if stack:
            stack.pop()
    for _ in [x for x in before if x not in (pickletools.markobject, pickletools.stackslice)]:
        if stack:
            stack.pop()
    for item in op.stack_after:
        stack.append(_MARK if item is pickletools.markobject else (arg if op.name in _STRINGS else None))


def _pickles(path: Path) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of what in ``path`` an unpickler could read: each ``.pkl`` member of a torch zip file, or the
    file itself (any protocol, also 0 and 1, which have no header; torch's legacy format is pickles in a row)."""
    with open_regular(path) as f:
        if f.read(2) == b"PK":
            f.seek(0)
            with zipfile.ZipFile(f) as z:
                members = [n for n in z.namelist() if n.endswith(".pkl")][:MAX_MEMBERS]
                for member in members:
                    yield f"{path} ({member})", z.read(member)
        else:
            f.seek(0)
            yield str(path), f.read()


def check_pickles(ckpt: Path) -> None:
    """Every pickle under ``ckpt`` names only allowed callables; ConfigError naming the file and the name."""
    for path in sorted(ckpt.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.suffix in _TEXT:
            continue
        for where, module, name in _names_in(path):
            if not allowed(module, name):
                raise ConfigError(
                    f"--resume_from_checkpoint: {where} would import {module}.{name} to load: a checkpoint holds "
                    "tensors and plain values only, so it is refused without running it; resume from a "
                    "checkpoint you trust, or start afresh with --overwrite_output_dir true"
                )


def _names_in(path: Path) -> Iterator[tuple[str, str, str]]:
    """(where, module, name) of each callable the pickles of ``path`` name, up to where a pickle stops parsing
    (the names before that point are the ones an unpickler would reach; the loader reports the rest)."""
    try:
        for where, data in _pickles(path):
            for module, name in pickle_names(data):
                yield where, module, name
    except (ValueError, zipfile.BadZipFile, EOFError):
        return


def structure_problem(path: Path) -> str | None:
    """What is wrong with a torch or pickle file, found without unpickling it (whichever loader would read it:
    accelerate's, DeepSpeed's, torch.distributed.checkpoint's): a zip member whose bytes fail their CRC, a pickle
    that ends before its STOP, or a callable it may not name; None when the file is whole."""
    try:
        with open_regular(path) as f:
            if f.read(2) == b"PK":
                f.seek(0)
                with zipfile.ZipFile(f) as z:
                    bad = z.testzip()
                    if bad is not None:
                        return f"its member {bad} is corrupt (CRC mismatch)"
                    for member in [n for n in z.namelist() if n.endswith(".pkl")][:MAX_MEMBERS]:
                        problem = _pickle_problem(z.read(member))
                        if problem is not None:
                            return f"{member}: {problem}"
                return None
            f.seek(0)
            return _pickle_problem(f.read())
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _pickle_problem(data: bytes) -> str | None:
    try:
        for module, name in pickle_names(data[: _first_stop(data)]):
            if not allowed(module, name):
                return f"it would import {module}.{name}, refused without running it"
    except ValueError as e:
        return f"not a whole pickle ({e})"
    return None


def _first_stop(data: bytes) -> int:
    """The length of the first pickle in ``data``; ValueError when it never reaches its STOP."""
    for op, _, pos in pickletools.genops(data):
        if op.name == "STOP":
            return pos + 1
    raise ValueError("it ends before its STOP opcode")


def _read_safetensors(path: Path) -> None:
    from safetensors import safe_open  # not at the top: as torch above

    with open_regular(path):  # regular, not a symlink: checked before safetensors opens it by name
        pass
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            f.get_tensor(key)


def _check_torch_file(path: Path) -> None:
    problem = structure_problem(path)
    if problem is not None:
        raise NotData(problem)


_READERS = {".bin": _check_torch_file, ".pt": _check_torch_file, ".pth": _check_torch_file, ".pkl": _check_torch_file}


def unreadable_parts(folder: Path, most: int = 3) -> list[tuple[Path, str]]:
    """The files under ``folder`` (up to ``most``) that are not whole, each with the reason. Run after a load
    failed, to name the files in the error. Torch and pickle files (accelerate's ``.pkl`` are ``torch.save``
    output) are checked without unpickling (pickle_scan.structure_problem): a corrupt zip member, a torn pickle
    or a refused callable is named; a payload is never run, and a file another loader reads (DeepSpeed's) is not
    blamed for holding that loader's types."""
    bad = []
    for p in sorted(folder.rglob("*")):
        reader = _READERS.get(p.suffix, _read_safetensors if p.suffix == ".safetensors" else None)
        if reader is None or p.is_symlink() or not p.is_file():
            continue
        try:
            reader(p)
        except Exception as e:  # noqa: BLE001 - each reader raises its own type; its text is the cause
            bad.append((p, first_line(e)))
            if len(bad) == most:
                break
    return bad
