"""The layout's rules, checked on the code itself (tools/import_graph.py): no import cycles, no
module importing from a layer above its own, and a top level of hvps/ that holds only the facade
and the rooms."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph
_spec.loader.exec_module(import_graph)


def test_no_cycles_and_no_upward_imports():
    assert import_graph.violations() == []


def test_every_module_has_a_layer():
    for module in import_graph.modules():
        import_graph.layer_of(module)  # raises for a module outside every layer


def test_top_level_holds_the_facade_and_rooms():
    modules = sorted(p.name for p in (ROOT / "hvps").glob("*.py"))
    assert modules == ["__init__.py", "version.py"], modules


def test_adapters_live_inside_the_package():
    """``hvps.adapters.torch`` is found by the plain path search from the checkout's root, as with
    ``PYTHONPATH=.`` in a bare checkout (no ``package_dir`` mapping), and the imported package agrees."""
    expected = ROOT / "hvps" / "adapters" / "torch" / "__init__.py"
    path = [str(ROOT)]
    for name in ("hvps", "hvps.adapters", "hvps.adapters.torch"):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        assert spec is not None, name
        path = spec.submodule_search_locations
    assert Path(spec.origin) == expected
    assert Path(importlib.util.find_spec("hvps.adapters.torch").origin).resolve() == expected.resolve()
    assert not (ROOT / "adapters").exists()


def test_checker_sees_cycles_and_upward_imports(tmp_path):
    """The checker itself: a planted cycle (one import inside a function) and an upward import."""
    core = tmp_path / "hvps" / "core"
    core.mkdir(parents=True)
    (tmp_path / "hvps" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "a.py").write_text("from . import b\n")
    (core / "b.py").write_text("def f():\n    from .a import x\n")
    (core / "c.py").write_text("import hvps.api\n")
    (tmp_path / "hvps" / "api.py").write_text("")
    found = import_graph.violations(tmp_path)
    assert "cycle: hvps.core.a <-> hvps.core.b" in found
    assert any(line.startswith("upward: hvps.core.c (layer 0) imports hvps.api") for line in found)
