"""One-line YAML parse errors, shared by the config, catalog and sweep-spec readers."""
from __future__ import annotations

import yaml


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, without the quoted source lines PyYAML appends."""
    problem = getattr(exc, "problem", None) or "parse error"
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem
