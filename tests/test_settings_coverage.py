"""Every ``HVPS_*`` variable the code names is listed in ``hvps.core.settings.VARIABLES`` and in the
settings table of the docs (docs/settings.md), and only ``hvps.core.settings`` reads one from ``os.environ``."""

import ast
import logging
import re
from pathlib import Path

import pytest

from hvps.core.errors import HvpsError
from hvps.core.settings import (ALIASES, LAUNCHER_VARIABLES, VARIABLES, Settings, env_text,
                                unhonoured_horovod_variables, warn_unhonoured_horovod_variables)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "hvps" / "core" / "settings.py"
NAME = re.compile(r"HVPS_[A-Z0-9]+(?:_[A-Z0-9]+)*(?![A-Z0-9_])")  # a trailing "_" is a prefix, not a name


def _sources():
    for path in sorted((ROOT / "hvps").rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _strings(tree):
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _module_constants(tree) -> dict:
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def _is_os_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def environ_reads(tree) -> list:
    """HVPS_* names read through os.environ.get / os.environ[...] / os.getenv in ``tree``."""
    constants = _module_constants(tree)

    def name_of(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name):
            return constants.get(arg.id)
        return None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_os_environ(func.value):
                key = name_of(node.args[0])
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv"
                  and isinstance(func.value, ast.Name) and func.value.id == "os"):
                key = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_os_environ(node.value):
            key = name_of(node.slice)
        if key and key.startswith("HVPS_"):
            found.append(key)
    return found


def test_every_named_variable_is_listed():
    named = {}
    for path, tree in _sources():
        for text in _strings(tree):
            for name in NAME.findall(text):
                named.setdefault(name, path.relative_to(ROOT))
    missing = {name: str(where) for name, where in named.items() if name not in VARIABLES}
    assert not missing, f"named in the code but not in hvps.core.settings.VARIABLES: {missing}"


def test_every_listed_variable_is_in_the_docs_settings_table():
    table = (ROOT / "docs" / "settings.md").read_text().split("# Settings", 1)[1].split("\n## ", 1)[0]
    assert not [name for name in VARIABLES if f"`{name}`" not in table]


def test_only_settings_reads_the_environment():
    readers = {f"{path.relative_to(ROOT)}: {name}" for path, tree in _sources() if path != SETTINGS
               for name in environ_reads(tree)}
    assert not readers, f"read from os.environ outside hvps.core.settings: {sorted(readers)}"


def test_the_checks_see_what_they_look_for():
    tree = ast.parse('import os\nKEY = "HVPS_X"\na = os.environ.get(KEY)\nb = os.environ["HVPS_Y"]\n'
                     'c = os.getenv("HVPS_Z")\nos.environ["HVPS_W"] = "1"\n')
    assert environ_reads(tree) == ["HVPS_X", "HVPS_Y", "HVPS_Z"]
    assert NAME.findall("set HVPS_METRICS_* or HVPS_STALL_CHECK_TIME_SECONDS=3") == ["HVPS_STALL_CHECK_TIME_SECONDS"]


def test_unlisted_names_are_refused(monkeypatch):
    monkeypatch.setenv("HVPS_FUSION_THRESHOLD", "")
    assert env_text("HVPS_FUSION_THRESHOLD", "7") == "7"
    with pytest.raises(KeyError, match="not an hvps setting"):
        env_text("HVPS_NO_SUCH_SETTING")


def test_every_horovod_alias_names_a_listed_setting_and_is_in_the_docs():
    migrating = (ROOT / "docs" / "migrating.md").read_text()
    table = migrating.split("## Horovod's environment variables", 1)[1].split("\n## ", 1)[0]
    assert all(twin in VARIABLES for twin in ALIASES.values())
    assert not [name for name, twin in ALIASES.items() if f"| `{name}` | `{twin}` |" not in table]
    assert not set(ALIASES) & LAUNCHER_VARIABLES


def test_a_horovod_alias_is_read_when_its_twin_is_unset_and_loses_when_both_are(monkeypatch, caplog):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "2")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "5")
    monkeypatch.delenv("HVPS_CYCLE_TIME", raising=False)
    monkeypatch.delenv("HVPS_STALL_CHECK_TIME_SECONDS", raising=False)
    monkeypatch.delenv("HVPS_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    monkeypatch.delenv("HVPS_TIMELINE", raising=False)
    monkeypatch.delenv("HVPS_TIMELINE_MARK_CYCLES", raising=False)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    monkeypatch.setenv("HVPS_FUSION_THRESHOLD", "2048")
    with caplog.at_level(logging.INFO, logger="hvps"):
        settings = Settings.from_env()
        Settings.from_env()
    assert settings.cycle_time_ms == 3.5 and settings.timeline == "/tmp/t.json" and settings.timeline_mark_cycles
    assert (settings.stall_warn_seconds, settings.stall_fail_seconds) == (2.0, 5.0)
    assert settings.fusion_threshold == 2048
    both = [r for r in caplog.records if "both set" in r.getMessage()]
    assert len(both) == 1 and "HVPS_FUSION_THRESHOLD wins" in both[0].getMessage()


def test_a_bad_horovod_value_is_named_as_written(monkeypatch):
    monkeypatch.delenv("HVPS_CYCLE_TIME", raising=False)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "fast")
    with pytest.raises(HvpsError, match=r"^HOROVOD_CYCLE_TIME='fast' is not a number"):
        Settings.from_env()
    monkeypatch.setenv("HVPS_CYCLE_TIME", "fast")
    with pytest.raises(HvpsError, match=r"^HVPS_CYCLE_TIME='fast' is not a number"):
        Settings.from_env()
    monkeypatch.delenv("HVPS_HIERARCHICAL_ALLREDUCE", raising=False)
    monkeypatch.setenv("HVPS_CYCLE_TIME", "1")
    monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "yes")
    with pytest.raises(HvpsError, match=r"^HOROVOD_HIERARCHICAL_ALLREDUCE='yes' is unknown"):
        Settings.from_env()


def test_unhonoured_horovod_variables_are_warned_once_and_launchers_are_not(caplog):
    env = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_CYCLE_TIME": "2",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HOROVOD_AUTOTUNE_LOG": "/tmp/at.csv"}
    assert unhonoured_horovod_variables(env) == ["HOROVOD_AUTOTUNE_LOG", "HOROVOD_GLOO_TIMEOUT_SECONDS"]
    with caplog.at_level(logging.WARNING, logger="hvps"):
        first = warn_unhonoured_horovod_variables(env)
        again = warn_unhonoured_horovod_variables(env)
    assert first == ["HOROVOD_AUTOTUNE_LOG", "HOROVOD_GLOO_TIMEOUT_SECONDS"] and again == []
    warned = [r.getMessage() for r in caplog.records if "does not honour" in r.getMessage()]
    assert len(warned) == 1 and "HOROVOD_GLOO_TIMEOUT_SECONDS" in warned[0] and "HOROVOD_RANK" not in warned[0]
