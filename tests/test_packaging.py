"""The install extras: [vllm] brings the vLLM versions TRL supports, [deepspeed] DeepSpeed, and the docs name them;
the wheel's contents: every subpackage of armor_trl and every recipe under configs/ (shipped as armor_trl/configs, so
`armor-trl demo` and `study` find their recipes and arms outside a clone) are named in pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def trl_extra(extra: str) -> dict[str, Requirement]:
    """TRL's own requirements for one of its extras, from the installed TRL's metadata."""
    found = {}
    for line in requires("trl") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}) and \
                not requirement.marker.evaluate({"extra": ""}):
            found[requirement.name] = requirement
    return found


def test_vllm_extra_brings_the_vllm_that_trl_supports(project):
    extra = [Requirement(r) for r in project["optional-dependencies"]["vllm"]]
    core_trl = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "trl")
    assert [(r.name, r.extras) for r in extra] == [("trl", {"vllm"})]
    assert extra[0].specifier == core_trl.specifier  # the TRL this package runs on, so its vllm pin applies
    assert Version(version("trl")) in core_trl.specifier
    vllm = trl_extra("vllm")["vllm"]
    assert vllm.specifier  # TRL pins a range; ours is that range
    assert {"0.22.0", "0.31.0"} <= {spec.version for spec in vllm.specifier}  # TRL 1.16's: >=0.22.0,<=0.31.0


def test_deepspeed_extra_and_its_old_name(project):
    extras = project["optional-dependencies"]
    assert extras["deepspeed"] == extras["distributed"]  # `distributed` stays as an alias (the Makefile uses it)
    (ours,) = [Requirement(r) for r in extras["deepspeed"]]
    assert ours.name == "deepspeed"
    lowest = min(Version(spec.version) for spec in ours.specifier if spec.operator == ">=")
    assert lowest in trl_extra("deepspeed")["deepspeed"].specifier  # within what TRL's own extra accepts
    makefile = (REPO / "Makefile").read_text()
    for used in re.findall(r'pip install[^\n]*-e "\.\[([^\]]+)\]"', makefile):
        assert set(used.split(",")) <= set(extras)


def test_test_extra_has_tensorboard(project):
    assert "tensorboard" in {Requirement(r).name for r in project["optional-dependencies"]["test"]}


def test_readme_install_section_names_the_extras():
    readme = (REPO / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert 'pip install "armor-trl[vllm]"' in install and 'pip install "armor-trl[deepspeed]"' in install
    low, high = sorted((Version(s.version) for s in trl_extra("vllm")["vllm"].specifier))
    assert f"vLLM {low}–{high}" in install


def test_readme_field_table_documents_the_supported_loss_types_and_is_level():
    from armor_trl.config import SUPPORTED_LOSS_TYPES

    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `loss_type`"))
    assert all(f"`{loss}`" in row.split("only", 1)[1].split("ValueError")[0] for loss in SUPPORTED_LOSS_TYPES)
    assert "not been derived" in row
    row = next(line for line in readme.splitlines() if line.startswith("| `importance_sampling_level`"))
    assert '`"token"` only' in row and "per token" in row


# --- the wheel's contents ----------------------------------------------------------------------------------------
def _dotted(path: Path, root: Path, prefix: str) -> str:
    return ".".join([prefix, *path.relative_to(root).parts]) if path != root else prefix


def test_every_subpackage_and_config_folder_is_packaged():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    code = {_dotted(p.parent, REPO / "armor_trl", "armor_trl") for p in (REPO / "armor_trl").rglob("__init__.py")}
    configs = {_dotted(p.parent, REPO / "configs", "armor_trl.configs") for p in (REPO / "configs").rglob("*.yaml")}
    assert set(setuptools["packages"]) == code | configs
    assert setuptools["package-dir"] == {"armor_trl.configs": "configs"}
    assert all(setuptools["package-data"][name] == ["*.yaml"] for name in configs)


def test_recipes_are_found_in_the_clone():
    from armor_trl.experiments import demo, study

    assert study.CONFIGS == REPO / "configs"
    assert study.DEFAULT_ARMS_FILE.is_file() and demo.DEFAULT_CONFIG.is_file()
