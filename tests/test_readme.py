"""The README's setup and test commands are exactly what CI runs; the docs' examples are valid and
point only at files in the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_command_after(text: str, heading: str) -> str:
    block = text.split(heading, 1)[1]
    return re.search(r"```bash\n(.+?)\n```", block, re.S).group(1).strip()


def test_ci_runs_the_readme_setup_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = _first_command_after(readme, "Setup (")
    tests = _first_command_after(readme, "Tests (")
    ci_lines = [line.strip() for line in ci.splitlines()]
    assert setup in ci_lines
    assert tests in ci_lines
    assert "kvsim simulate --trace azure-conv-2023" in readme


def test_documented_config_example_is_the_default_config():
    import yaml

    from kvsim.sim.config import SimConfig

    readme = (ROOT / "docs" / "simulate.md").read_text()
    block = readme.split("Config file (every key optional; defaults shown):", 1)[1]
    example = re.search(r"```yaml\n(.+?)\n```", block, re.S).group(1)
    assert SimConfig.model_validate(yaml.safe_load(example)) == SimConfig()


def test_readme_is_a_front_page_and_docs_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
