"""The README's commands and CI stay in step."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def _readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- setup -->\s*```bash\n(.*?)```", readme, re.S)
    assert block, "README.md lost its set-up block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    example, tests = _readme_commands()
    assert "examples/" in example
    assert "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
    # then the oldest releases pyproject supports
    oldest = ci_lines.index("pip install $(python .ci/oldest.py)")
    assert oldest > ci_lines.index(tests) and "pytest" in ci_lines[-1]


def test_ci_and_readme_take_the_newest_torch_and_say_how_to_take_the_cpu_wheel():
    example, tests = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    # the newest run: torch's newest release as a floor before the README's command, never a pin
    # (the oldest run pins it)
    before = ci_lines[: ci_lines.index(tests)]
    assert not [line for line in before if "torch" in line and "pip install" in line]
    assert "pip install -r requirements-newest.txt" in before
    floors = [line for line in (ROOT / "requirements-newest.txt").read_text().splitlines() if not line.startswith("#")]
    assert floors == ["torch>=2.15"]
    assert "torch" not in example and "torch" not in tests
    readme = (ROOT / "README.md").read_text()
    assert "CPU-only" in readme and "/whl/cpu" in readme


def test_pre_commit_runs_the_ruff_ci_runs():
    import yaml

    (repo,) = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
    assert repo["repo"].endswith("/ruff-pre-commit")
    pinned = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "dev_tool.py"), "ruff"], check=True, capture_output=True, text=True
    )
    assert pinned.stdout.strip() == f"ruff=={repo['rev'].removeprefix('v')}"
    assert [hook["id"] for hook in repo["hooks"]] == ["ruff-check", "ruff-format"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ruff check . && ruff format --check ." in ci


def test_the_oldest_supported_releases_are_the_lower_bounds():
    pins = subprocess.run([sys.executable, str(ROOT / ".ci" / "oldest.py")], check=True, capture_output=True, text=True)
    assert pins.stdout.split() == [
        "torch==2.13.0",
        "transformers==5.23.0",
        "trl==1.16.0",
        "accelerate==1.15.0",
        "peft==0.21.0",
    ]


def test_readme_example_exists():
    example, _ = _readme_commands()
    script = re.search(r"python (examples/\S+\.py)", example).group(1)
    assert (ROOT / script).is_file()


def test_the_version_is_pyprojects():
    import tomllib

    import compile_pass

    stated = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert compile_pass.__version__ == stated


def test_an_installed_package_reads_its_metadata(tmp_path):
    """Outside a checkout (no pyproject.toml beside the package) the version is the installed
    distribution's; with none installed, "0+unknown". (.ci/smoke_wheel.py checks a real wheel.)"""
    import importlib.metadata

    from compile_pass._version import version_of

    package = tmp_path / "compile_pass"
    package.mkdir()
    assert version_of(package) == importlib.metadata.version("compile_pass")
    assert version_of(package, "no-such-distribution") == "0+unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9"\n')
    assert version_of(package, "no-such-distribution") == "0+unknown"  # another project's file
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "compile_pass"\nversion = "1.2.3"\n')
    assert version_of(package, "no-such-distribution") == "1.2.3"


def test_the_wheel_smoke_test_passes_in_a_users_environment():
    """CI's wheel smoke test (.ci/smoke_wheel.py), but for the check of the installed files, run
    from the checkout as a user runs it: none of the suite's settings (conftest.py sets
    COMPILE_PASS_MEASURE and COMPILE_PASS_SHORT_KEYS) in its environment, so that it depends on
    no setting it does not make itself."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("COMPILE_PASS_")}
    env["COMPILE_PASS_CACHE_DIR"] = str(Path(tempfile.mkdtemp(prefix="compile_pass_smoke_")))  # never a user's
    env["PYTHONPATH"] = str(ROOT)
    script = (
        "import runpy; smoke = runpy.run_path('.ci/smoke_wheel.py', run_name='smoke'); "
        "smoke['check_op'](); smoke['check_backend']()"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "a tiny Mistral through backend='compile_pass'" in run.stdout
