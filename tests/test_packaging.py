"""The package installs and runs the same way everywhere: metadata, environment, CLI entry points, CI."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tomllib
import yaml

from freqact import cli
from tests.conftest import REPO_ROOT


def _name(requirement: str) -> str:
    """The distribution name of a requirement string, normalised ('scikit-learn>=1' -> 'scikit-learn')."""
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_packages_as_pyproject():
    meta = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    # environment.yml pins python 3.11: requirements only for older Pythons do not apply there.
    wanted = {_name(r) for r in meta["dependencies"] + meta["optional-dependencies"]["dev"]
              if "python_version < '3.11'" not in r}
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    listed = set()
    for dep in env["dependencies"]:
        for item in dep["pip"] if isinstance(dep, dict) else [dep]:
            if not item.startswith("-e"):
                listed.add(_name(item))
    listed -= {"python", "pip"}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    assert "python=3.11" in env["dependencies"]


def test_ci_runs_the_readme_commands():
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart\n.*?```(?:bash|sh)\n(.*?)```", readme, re.S)
    assert block, "README.md needs a Quickstart section with one bash code block"
    commands = [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, f"the Quickstart has exactly two commands, found {commands}"
    install, test = commands
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    # CI installs what the README installs plus the `gpu` extra (Triton, for the interpreter tests)
    readme_install = install.split(" && ")[0]
    extras = re.search(r'"\.\[([a-z,]+)\]"', readme_install)
    assert extras, f"the README installs the project with extras, found {readme_install!r}"
    ci_install = readme_install.replace(extras.group(0), f'".[{extras.group(1)},gpu]"')
    assert ci_install in ci.splitlines(), f"CI must install with {ci_install!r}"
    assert test in ci.splitlines(), "CI must run the README's test command verbatim"


def test_dev_extra_leaves_the_gpu_and_notebook_ui_packages_to_their_own_extras():
    # `[dev]` is what the tests need on a CPU-only machine: Triton (1 GB) and JupyterLab are opt-in.
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = {_name(r) for r in extras["dev"]}
    assert not dev & {"triton", "jupyter", "jupyterlab", "notebook"}, dev
    assert {_name(r) for r in extras["gpu"]} == {"triton"}
    assert {_name(r) for r in extras["notebooks"]} == {"jupyterlab"}


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, *_ in cli._commands():
        assert name in out


def test_no_command_prints_help_and_succeeds(capsys):
    assert cli.main([]) == 0
    assert "usage: freqact" in capsys.readouterr().out


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "freqact", "--version"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("freqact ")


@pytest.mark.slow
def test_wheel_ships_the_data_files_the_code_reads(tmp_path):
    # The C kernel source is compiled at run time and the sweep presets are read at run time:
    # a non-editable install must carry both.
    import importlib.metadata
    import importlib.util
    import shutil
    import zipfile

    setuptools_version = tuple(int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
    if setuptools_version < (70, 1) and importlib.util.find_spec("wheel") is None:
        pytest.skip("building a wheel offline needs setuptools >= 70.1 or the wheel package")

    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the repository
    shutil.copytree(REPO_ROOT / "freqact", src / "freqact",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("freqact-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "freqact/kernels/cpu_division.c" in names
    assert any(n.startswith("freqact/presets/") and n.endswith(".toml") for n in names)
