"""The layering the design promises, checked on what Python actually imports (each check in a fresh
interpreter): serve -> cluster -> actors -> engine -> models; the engine knows no model family, the
models know no placement, the actors know neither the control plane nor the ingress, the control
plane knows no ingress, and nothing below the actors loads Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import rackserve

ROOT = Path(rackserve.__file__).parent
BELOW_ACTORS = ("engine", "models", "kernels", "collective", "transfer")


def modules_under(package: str) -> list[str]:
    """Every module of `rackserve.<package>`, subpackages included, from the files (nothing is imported)."""
    names = []
    for file in sorted((ROOT / package).rglob("*.py")):
        parts = file.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def loaded_after(modules: list[str]) -> set[str]:
    """The modules a fresh interpreter has loaded after importing `modules`."""
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


def test_the_engine_imports_no_model_family():
    loaded = loaded_after(modules_under("engine"))
    families = {m for m in loaded if m.startswith(("rackserve.models.deepseek_v4", "rackserve.models.qwen3_moe"))}
    assert not families


def test_the_models_import_nothing_from_placement():
    loaded = loaded_after(modules_under("models"))
    assert "rackserve.models.deepseek_v4.model" in loaded  # the check saw the families
    assert not {m for m in loaded if m.startswith("rackserve.placement")}


def test_nothing_below_the_actors_imports_ray():
    modules = [m for package in BELOW_ACTORS for m in modules_under(package)]
    assert "rackserve.transfer.kv_agent" in modules and "rackserve.engine.engine" in modules
    loaded = loaded_after(modules)
    assert not {m for m in loaded if m == "ray" or m.startswith("ray.")}


def test_the_actors_import_neither_the_control_plane_nor_the_ingress():
    loaded = loaded_after(modules_under("actors"))
    assert "rackserve.actors.dp_rank" in loaded
    assert not {m for m in loaded if m.startswith(("rackserve.cluster", "rackserve.serve"))}


def test_the_control_plane_imports_no_ingress():
    loaded = loaded_after(modules_under("cluster"))
    assert "rackserve.cluster.deployment" in loaded
    assert not {m for m in loaded if m.startswith("rackserve.serve")}



def imported_by(module_file: Path) -> set[str]:
    """The modules a file's import statements name, wherever they stand (inside functions too)."""
    tree = ast.parse(module_file.read_text())
    return {node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names if not isinstance(node, ast.ImportFrom) or node.module}


def test_a_family_config_is_data_that_imports_no_state_or_model():
    """Importing a family's package loads all of it, so this is read from the files: the config is
    what the state and the model are built from, never the other way round."""
    for family in ("deepseek_v4", "deepseek_v41", "qwen3_moe"):
        named = imported_by(ROOT / "models" / family / "config.py")
        assert "rackserve.config" in named
        assert not {m for m in named if m.rsplit(".", 1)[-1] in ("state", "model", "loader")}, (family, named)
