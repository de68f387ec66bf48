"""The GPU study's script and the wheelhouse, without a GPU: the dry run on local GSM8K-shaped files and the tiny
model (through scripts/gpu_study.sh, as on the GPU machine), each bad input failing with a message naming its flag,
installs only from a given wheelhouse (never otherwise), the wheelhouse's package list covering what armor-trl
needs beyond the GPU image, its size limit, and gpu_check.sh handing --wheelhouse to the installer."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from testing import GSM8K_ROWS, write_parquet

REPO = Path(__file__).resolve().parents[1]
GSM8K_TEST = REPO / "tests" / "fixtures" / "gsm8k_test_late_numbers.jsonl"  # 3 GSM8K test rows
OFFLINE_NAMES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
                 "TOKENIZERS_PARALLELISM", "ARMOR_VERIFIER_WORKERS")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


gpu_study = _load("gpu_study")
wheelhouse = sys.modules["wheelhouse"]  # the module gpu_study installs through


@pytest.fixture
def env(monkeypatch):
    """gpu_study sets the offline variables in its process: give them back after each test."""
    for name in OFFLINE_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return monkeypatch


@pytest.fixture
def no_install(env):
    """Fail the test if anything would run pip."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"no install expected, got {args}")

    env.setattr(wheelhouse, "run", refuse)


@pytest.fixture
def files(tmp_path, tiny_model_path):
    train = write_parquet(tmp_path / "gsm8k_train.parquet", GSM8K_ROWS * 3)  # parquet, as the hub's GSM8K files
    return {"model": tiny_model_path, "train": train, "test": str(GSM8K_TEST), "out": str(tmp_path / "study")}


def argv(files, *extra):
    return ["--model", files["model"], "--train", files["train"], "--test", files["test"], "--output_dir", files["out"],
            *extra]


# --- the dry run ---------------------------------------------------------------------------------------------------
def test_dry_run_through_the_shell_script_prints_the_plan(files):
    """What CI checks of the GPU study: the real entry point, in a subprocess, on the tiny model and GSM8K rows."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_study.sh"), *argv(files, "--dry_run")],
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "GPU study plan (dry run" in out and "installing" not in out
    assert f"model:    {Path(files['model']).resolve()}" in out
    assert "6 of 6 problems (answer format gsm8k)" in out and "3 of 3 problems x 2 samples" in out
    assert "the train file holds 6 problems, the recipe asks for 64" in out
    for line in ('grpo: {"method": "grpo", "beta": 0.0}', '"learning_rate": 1.75e-06',  # 2e-6 x 7/8
                 'grpo_kl_0.04: {"method": "grpo", "beta": 0.04}', 'armor: {"method": "armor"}'):
        assert line in out
    assert "runs:     8 (4 arms x 2 seeds), 8 to run; 8 at once on the GPU" in out
    assert not Path(files["out"]).exists()  # a dry run writes nothing


def test_dry_run_installs_nothing_without_a_wheelhouse_and_never_checks_cuda(files, no_install, monkeypatch, capsys):
    monkeypatch.setattr(gpu_study, "check_cuda", lambda: pytest.fail("the dry run must not need CUDA"))
    assert gpu_study.main(argv(files, "--dry_run", "--seeds", "3", "--arms", "grpo,armor", "--workers", "2")) == 0
    out = capsys.readouterr().out
    assert "runs:     6 (2 arms x 3 seeds), 6 to run; 2 at once on the GPU" in out and "seeds:    [0, 1, 2]" in out


def test_dry_run_counts_finished_runs(files, no_install, capsys):
    metrics = Path(files["out"]) / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "grpo-seed1.jsonl").write_text("{}\n")
    assert gpu_study.main(argv(files, "--dry_run")) == 0
    assert "8 (4 arms x 2 seeds), 7 to run, 1 already finished; 7 at once" in capsys.readouterr().out


def test_the_study_itself_on_the_cpu(files, tmp_path, no_install, monkeypatch, capsys):
    """The path a GPU run takes after its checks, on the CPU: a variant of the recipe (`base:`, CPU sizes), CUDA's
    check stood in for; the recipe run_study reads holds the local paths, the study writes its files, a rerun
    skips the finished runs."""
    variant = tmp_path / "cpu.yaml"
    variant.write_text(f"base: {REPO / 'configs' / 'gpu_study_gsm8k.yaml'}\nbf16: false\nuse_cpu: true\n"
                       "dtype: float32\nmax_steps: 2\nval_every_steps: 1\nmax_completion_length: 6\n"
                       "val_max_new_tokens: 6\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
                       "num_generations: 4\nval_batch_size: 8\n")
    monkeypatch.setattr(gpu_study, "check_cuda", lambda: {"gpu": "none (test)", "gpus": 0})
    args = argv(files, "--config", str(variant), "--arms", "grpo,armor", "--seeds", "1", "--workers", "1")
    assert gpu_study.main(args) == 0, capsys.readouterr().err
    out = Path(files["out"])
    recipe = yaml.safe_load((out / "gpu_study_recipe.yaml").read_text())
    assert (recipe["model_name_or_path"], recipe["dataset_name"], recipe["eval_dataset_name"]) == (
        str(Path(files["model"]).resolve()), str(Path(files["train"]).resolve()), str(GSM8K_TEST))
    assert {p.name for p in (out / "metrics").iterdir()} == {"grpo-seed0.jsonl", "armor-seed0.jsonl"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs_executed"] == 2 and summary["evaluation"]["problems"] == 3
    assert json.loads((out / "environment.jsonl").read_text())["gpu"] == "none (test)"
    assert (out / "summary.md").is_file() and (out / "curves.png").is_file()
    capsys.readouterr()
    assert gpu_study.main(args) == 0  # resumed: nothing left to run
    assert "2 already finished" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["runs_executed"] == 0
    assert len((out / "environment.jsonl").read_text().splitlines()) == 2  # one line per start, none overwritten
    written = (out / "gpu_study_recipe.yaml").read_text()
    other = tmp_path / "other.jsonl"
    other.write_text(GSM8K_TEST.read_text())
    args[args.index("--test") + 1] = str(other)  # other data, same folder: refused before anything is written
    assert gpu_study.main(args) == 2
    assert f"--output_dir {out}: holds a study of another recipe, model or data" in capsys.readouterr().err
    assert (out / "gpu_study_recipe.yaml").read_text() == written


# --- bad input -----------------------------------------------------------------------------------------------------
def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case, message", [
    ("missing_model", "--model {missing}: no such folder"),
    ("model_without_config", "--model {empty}: no config.json there"),
    ("model_without_weights", "--model {configonly}: no weights there"),
    ("missing_train", "--train {missing}: no such file"),
    ("train_is_a_folder", "--train {empty}: a folder, not a file"),
    ("empty_test", "--test {emptyfile}: empty file"),
    ("missing_test", "--test {missing}: no such file"),
    ("train_of_another_schema", "--train {other}: cannot be read as a math dataset: Cannot tell the schema"),
    ("train_not_a_data_file", "--train {text}: unsupported file type"),
    ("unknown_arm", "--arms: Unknown arm(s) nope"),
    ("missing_config", "--config {missing}: no such recipe file"),
])
def test_bad_input_fails_naming_the_flag(case, message, files, tmp_path, no_install, capsys):
    paths = {"missing": str(tmp_path / "nowhere"), "empty": str(tmp_path / "empty"),
             "configonly": str(tmp_path / "configonly"), "emptyfile": _write(tmp_path / "empty.jsonl", ""),
             "other": _write(tmp_path / "other.jsonl", '{"foo": 1, "bar": 2}\n'),
             "text": _write(tmp_path / "gsm8k.txt", "What is 1+1? #### 2\n")}
    Path(paths["empty"]).mkdir()
    Path(paths["configonly"]).mkdir()
    _write(Path(paths["configonly"]) / "config.json", "{}")
    changes = {"missing_model": ("--model", paths["missing"]), "model_without_config": ("--model", paths["empty"]),
               "model_without_weights": ("--model", paths["configonly"]),
               "missing_train": ("--train", paths["missing"]), "train_is_a_folder": ("--train", paths["empty"]),
               "empty_test": ("--test", paths["emptyfile"]), "missing_test": ("--test", paths["missing"]),
               "train_of_another_schema": ("--train", paths["other"]),
               "train_not_a_data_file": ("--train", paths["text"]),
               "unknown_arm": ("--arms", "grpo,nope"), "missing_config": ("--config", paths["missing"])}
    flag, value = changes[case]
    args = argv(files, "--dry_run")
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    assert gpu_study.main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("gpu_study: error: ")]
    assert len(errors) == 1 and message.format(**paths) in errors[0], err  # one line naming the flag
    assert "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--seeds", "0"), ("--seeds", "-2"), ("--seeds", "two"), ("--workers", "0")])
def test_bad_counts_fail_naming_the_flag(flag, value, files, no_install, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_study.main(argv(files, "--dry_run", flag, value))
    assert exit_.value.code == 2
    assert f"argument {flag}: expected an integer >= 1, got '{value}'" in capsys.readouterr().err


def test_out_is_a_deprecated_alias_of_output_dir(files, capsys):
    args = gpu_study.parse_args([*argv(files)[:-2], "--out", "elsewhere"])
    assert args.output_dir == "elsewhere"
    assert capsys.readouterr().err.count("--out is deprecated and will be removed; use --output_dir") == 1
    assert gpu_study.parse_args(argv(files)).output_dir == files["out"] and "deprecated" not in capsys.readouterr().err


def test_missing_flags_are_named(capsys):
    with pytest.raises(SystemExit):
        gpu_study.main(["--model", "m", "--dry_run"])
    assert "the following arguments are required: --train, --test" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
                    reason="needs a machine without CUDA")
def test_a_real_run_without_cuda_says_so(files, no_install, capsys):
    assert gpu_study.main(argv(files)) == 1
    err = capsys.readouterr().err
    assert "no CUDA device visible" in err and "--dry_run" in err
    assert not Path(files["out"]).exists()


# --- installing: from a given wheelhouse only ------------------------------------------------------------------------
def test_missing_packages_without_a_wheelhouse_say_how_to_build_one(files, no_install, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse, "MODULES", (*wheelhouse.MODULES, "trl_that_is_not_there"))
    assert gpu_study.main(argv(files, "--dry_run")) == 1
    err = capsys.readouterr().err
    assert "not importable here: trl_that_is_not_there" in err
    assert "make wheelhouse" in err and "--wheelhouse wheelhouse" in err


@pytest.mark.parametrize("layout, message", [("none", "no such folder; build one with `make wheelhouse`"),
                                             ("no_project_wheel", "holds no armor-trl wheel")])
def test_a_bad_wheelhouse_fails_before_pip(layout, message, files, tmp_path, no_install, capsys):
    folder = tmp_path / "wheels"
    if layout == "no_project_wheel":
        folder.mkdir()
        (folder / "trl-1.16.0-py3-none-any.whl").write_bytes(b"")
    assert gpu_study.main(argv(files, "--dry_run", "--wheelhouse", str(folder))) == 1
    err = capsys.readouterr().err
    assert f"--wheelhouse {folder}: {message}" in err, err


@pytest.mark.parametrize("pip_exit", [0, 1])
def test_a_wheelhouse_is_installed_with_no_index(pip_exit, files, tmp_path, env, capsys):
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "armor_trl-0.1.0-py3-none-any.whl").write_bytes(b"")
    calls = []

    def fake_run(command, *args, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, pip_exit)

    env.setattr(wheelhouse, "run", fake_run)
    code = gpu_study.main(argv(files, "--dry_run", "--wheelhouse", str(folder)))
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder), "armor-trl"]]
    captured = capsys.readouterr()
    if pip_exit == 0:
        assert code == 0 and "GPU study plan" in captured.out
    else:
        assert code == 1 and "`pip install --no-index` failed (exit 1" in captured.err
        assert "WHEELHOUSE_EXTRA" in captured.err and "GPU study plan" not in captured.out


# --- the wheelhouse's contents ---------------------------------------------------------------------------------
def _closure(names) -> set[str]:
    """Installed distributions ``names`` need, transitively (base requirements for this Python, no extras)."""
    seen, todo = set(), [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            lines = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in lines:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def test_the_wheelhouse_holds_what_the_image_does_not():
    """Every package armor-trl needs is in the GPU image (with its dependencies) or in the wheelhouse, and the
    wheelhouse holds nothing the image already has except the named fallbacks: the static half of
    `make wheelhouse-check`, from this venv's metadata (the versions the wheelhouse pins)."""
    needed = _closure(["armor-trl"]) - {"armor-trl"}
    image = _closure(wheelhouse.IMAGE)
    wheels = {canonicalize_name(n) for n in wheelhouse.WHEELS}
    fallbacks = {canonicalize_name(n) for n in wheelhouse.FALLBACKS}
    assert needed - image - wheels == set()
    assert wheels <= needed and not wheels & image  # nothing superfluous, nothing the image has
    assert fallbacks <= needed and fallbacks <= image
    assert {"trl", "datasets", "math-verify"} <= wheels


def test_build_pins_this_venvs_versions_and_enforces_the_size_limit(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, *args, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("--dest" if "--dest" in command else "--wheel-dir") + 1])
        (dest / f"fake{len(calls)}-py3-none-any.whl").write_bytes(b"0" * 2**19)  # 0.5 MiB each
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(wheelhouse, "run", fake_run)
    (tmp_path / "keep.txt").write_text("not a wheel")
    wheelhouse.build(tmp_path, extra=["pyarrow==26.0.1"], max_mib=2.5)
    assert (tmp_path / "keep.txt").exists()  # only wheels are cleared
    wheel, *downloads = calls
    assert wheel[3:6] == ["wheel", "--quiet", "--no-deps"]
    assert [c[c.index("--python-version") + 1] for c in downloads] == list(wheelhouse.PYTHON_VERSIONS)
    from importlib.metadata import version
    for command in downloads:
        assert "--no-deps" in command and "--only-binary=:all:" in command
        assert f"trl=={version('trl')}" in command and "pyarrow==26.0.1" in command
        assert all(f"{name}=={version(name)}" in command for name in wheelhouse.WHEELS)
    with pytest.raises(wheelhouse.WheelhouseError, match=r"MiB, over the 1 MiB limit; largest: fake"):
        wheelhouse.build(tmp_path, max_mib=1.0)


def test_makefile_target_and_gitignore():
    makefile = (REPO / "Makefile").read_text()
    assert "\nwheelhouse: $(STAMP)" in makefile and "scripts/wheelhouse.py build" in makefile
    assert "WHEELHOUSE_MAX_MIB ?= 60" in makefile
    assert "/wheelhouse/" in (REPO / ".gitignore").read_text().splitlines()


# --- gpu_check.sh hands --wheelhouse to the installer ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["flag", "flag=", "env", "none"])
def test_gpu_check_installs_from_the_wheelhouse(how):
    args = {"flag": ["--wheelhouse", "/w"], "flag=": ["--wheelhouse=/w"]}.get(how, [])
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("ARMOR_WHEELHOUSE", None)
    if how == "env":
        env["ARMOR_WHEELHOUSE"] = "/w"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry_run", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    install = [line for line in done.stdout.splitlines() if line.startswith("| install |")]
    assert len(install) == (0 if how == "none" else 1)
    if install:
        assert "pip install --no-index from /w" in install[0]
        parts = _load("gpu_check_parts").plan("out", "/w", full=False)
        assert parts[0].command[1:] == ["scripts/wheelhouse.py", "install", "/w"]


def test_the_wheelhouse_installs_deepspeed_where_it_holds_its_wheel(tmp_path):
    wheelhouse = _load("wheelhouse")
    (tmp_path / "armor_trl-0.1-py3-none-any.whl").write_text("")
    assert wheelhouse.install_command(tmp_path, "python")[-1] == "armor-trl"
    (tmp_path / "deepspeed-0.19.8-py3-none-any.whl").write_text("")
    assert wheelhouse.install_command(tmp_path, "python")[-2:] == ["armor-trl", "deepspeed"]


def test_the_opt_in_deepspeed_wheels_come_at_the_locks_versions(tmp_path, monkeypatch):
    wheelhouse = _load("wheelhouse")
    calls = []

    def fake_run(command, **kwargs):
        calls.append([str(c) for c in command])
        if "wheel" in command:
            (tmp_path / "fake-1.0-py3-none-any.whl").write_bytes(b"x")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(wheelhouse, "run", fake_run)
    wheelhouse.build(tmp_path, deepspeed=True, python_versions=("3.12",))
    locked = wheelhouse.read_lock(wheelhouse.LOCK)
    deepspeed_build = next(c for c in calls if "--no-binary" in c)
    assert f"deepspeed=={locked['deepspeed']}" in deepspeed_build
    download = next(c for c in calls if "download" in c)
    for name in wheelhouse.DEEPSPEED_WHEELS:
        assert f"{name}=={locked[wheelhouse.canonical(name)]}" in download
    calls.clear()
    wheelhouse.build(tmp_path, python_versions=("3.12",))  # opt-in: not without --deepspeed
    assert not any("--no-binary" in c for c in calls) and not any("hjson" in " ".join(c) for c in calls)
