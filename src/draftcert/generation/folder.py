"""The folder form of ``draftcert.generate``: ``<path>/custom_generate/generate.py`` for the hub.

transformers loads a folder (a local path or a hub repository) holding ``custom_generate/generate.py``
with ``model.generate(..., custom_generate=PATH_OR_REPO, trust_remote_code=True)``: it checks
``custom_generate/requirements.txt`` against the installed packages, imports ``generate.py`` and calls
its ``generate(model=model, **arguments)`` with ``generate``'s own arguments, *before* any input
preparation.  The shipped ``generate.py`` (``HUB_FOLDER``) imports draftcert and delegates to
``folder_generate``, which hands the arguments back to ``generate`` with the callable
``draftcert.generate``, so both forms prepare inputs and decode identically.

Write the folder with ``python -c "from draftcert.generation import write_folder; write_folder('DIR')"``
and push DIR to a hub model repository to share it.
"""

from __future__ import annotations

from pathlib import Path

from ..fileio import atomic_write
from .custom import check_transformers, generate

__all__ = ["HUB_FOLDER", "write_folder", "folder_generate"]

HUB_FOLDER = Path(__file__).resolve().parent / "hub" / "custom_generate"  # shipped as package data
_FILES = ("generate.py", "requirements.txt")


def write_folder(path) -> Path:
    """Write ``<path>/custom_generate/generate.py`` and ``requirements.txt``; returns ``<path>``."""
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"write_folder: {str(root)!r} exists and is not a directory; pass a directory path")
    dest = root / "custom_generate"
    dest.mkdir(parents=True, exist_ok=True)
    for name in _FILES:
        atomic_write(dest / name, (HUB_FOLDER / name).read_text())
    return root


def folder_generate(model, **arguments):
    """What the folder's ``generate.py`` calls: ``generate``'s raw arguments (``inputs``,
    ``generation_config``, ``streamer``, ``assistant_model``, the caller's keywords, ...) handed back
    to the model class's ``generate`` with ``custom_generate=draftcert.generate``.

    The class's method, not ``model.generate``: a model loaded with ``from_pretrained(DIR,
    trust_remote_code=True)`` from a folder holding ``custom_generate/`` has its instance ``generate``
    replaced by this very function, which would recurse.
    """
    check_transformers()
    arguments.pop("custom_generate", None)
    return type(model).generate(model, **arguments, custom_generate=generate)
