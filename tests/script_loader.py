"""Load a file of scripts/ as a module (they are command-line tools, not a package) for the CPU tests."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def load_script(name: str):
    """scripts/<name>.py as a fresh module."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
