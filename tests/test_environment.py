"""environment.yml (the conda route) lists the same dependencies as pyproject.toml."""
import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_BY_RUN_SH = {"mamba-ssm"}  # needs build settings that conda's pip section cannot pass


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    lines = (ROOT / "environment.yml").read_text().splitlines()
    pip_at = lines.index("  - pip:")
    listed = {_name(m.group(1)) for line in lines[pip_at + 1:]
              if (m := re.match(r"\s+- ([A-Za-z0-9].*?)\s*(#.*)?$", line))}
    assert declared - INSTALLED_BY_RUN_SH <= listed, f"missing from environment.yml: {declared - listed}"
    assert not INSTALLED_BY_RUN_SH & listed
    assert "  - python=3.11" in lines
