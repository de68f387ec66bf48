"""The wheelhouse: armor-trl and the packages a GPU image without network lacks, installed there with
``pip install --no-index --find-links DIR armor-trl`` (docs/gpu_study.md).

    python scripts/wheelhouse.py build [--dest wheelhouse] [--extra NAME==VERSION ...] [--deepspeed]   (make wheelhouse)
    python scripts/wheelhouse.py check [--wheelhouse wheelhouse]                          (make wheelhouse-check)
    python scripts/wheelhouse.py install DIR                                              (scripts/gpu_*.sh)
    python scripts/wheelhouse.py missing          (exit 1 naming the modules this Python cannot import)

The GPU machines this is for have torch, transformers, peft, accelerate and the usual scientific stack (numpy,
pandas, pyarrow, matplotlib, ...: :data:`IMAGE`), no network and no trl. ``build`` downloads :data:`WHEELS` (and
:data:`FALLBACKS`) at the versions of the lock requirements/dev.txt, i.e. the versions the test suite ran
with, plus the project's own wheel; ``check`` proves the list complete by installing from the wheelhouse alone
into a scratch venv holding only :data:`IMAGE`. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/lockfile.py, also when loaded as a module
from lockfile import LOCKS, canonical, read_lock  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOCK = LOCKS["dev"]  # the wheels' versions: those of the lock the tests install
PROJECT = "armor-trl"
# Not in the GPU image: trl, and what trl and armor-trl need beyond the image (datasets with its pinned dill and
# multiprocess; math-verify with its LaTeX parser).
WHEELS = ("trl", "datasets", "dill", "multiprocess", "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime")
# In the image, but pure Python and bounded by a requirement the image's copy may miss (datasets: fsspec<=2026.9.0;
# armor-trl: peft>=0.18): pip takes these only where the installed one does not satisfy the requirement.
FALLBACKS = ("fsspec", "peft")
# What the GPU image is assumed to provide (its package list, as read on such a machine; versions mostly unknown).
# `check` installs exactly these from the index into its scratch venv (their own dependencies come along, as they
# do in the image). torch is the CPU build here.
IMAGE = ("torch", "transformers", "peft", "accelerate", "pyarrow", "pandas", "matplotlib", "xxhash", "jinja2",
         "psutil", "pyyaml", "tqdm")
# Opt-in (build --deepspeed, `make wheelhouse WHEELHOUSE_DEEPSPEED=1`): DeepSpeed and what the GPU image lacked for it
# on the first GPU run (2026-12-04), at the lock's versions. DeepSpeed publishes no wheel: it is built here, pure Python
# (its ops are compiled at run time where needed); pydantic-core is compiled, one wheel per CPython version.
DEEPSPEED_WHEELS = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
DEEPSPEED = "deepspeed"
# Modules the project imports at run time; a machine lacking one needs the wheelhouse.
MODULES = ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "math_verify", "yaml", "matplotlib",
           "tqdm")
# multiprocess ships one wheel per CPython version (py311-none-any, ...); the GPU image's Python is 3.12, the others
# are there so that a machine with another CPython 3.11-3.13 also finds one (trl 1.16 needs >= 3.11). Every other
# wheel is py3-none-any.
PYTHON_VERSIONS = ("3.11", "3.12", "3.13")
# Wheels for Linux x86_64 only, should a compiled package be added with --extra (glibc >= 2.17).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
MAX_MIB = 60


class WheelhouseError(Exception):
    """A problem with a wheelhouse or its installation, with what to do about it."""


def run(command, **kwargs) -> subprocess.CompletedProcess:
    """Every command this module runs (one place for tests to stand in for pip)."""
    return subprocess.run(command, **kwargs)


# --- install (on the GPU machine) -------------------------------------------------------------------------------
def missing_modules(modules=None) -> list[str]:
    importlib.invalidate_caches()  # see what a pip run in a subprocess just installed
    return [m for m in (MODULES if modules is None else modules) if importlib.util.find_spec(m) is None]


def project_wheels(wheelhouse: Path) -> list[Path]:
    return sorted(wheelhouse.glob(f"{PROJECT.replace('-', '_')}-*.whl"))


def install_command(wheelhouse: Path, python: str = sys.executable) -> list[str]:
    """pip's command: armor-trl, and deepspeed too where the wheelhouse holds its wheel (built with --deepspeed)."""
    wanted = [PROJECT] + ([DEEPSPEED] if sorted(wheelhouse.glob(f"{DEEPSPEED}-*.whl")) else [])
    return [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse), *wanted]


def install(wheelhouse: str | os.PathLike, flag: str = "--wheelhouse") -> None:
    """Install armor-trl and what it needs from ``wheelhouse`` only (never the network)."""
    path = Path(wheelhouse)
    if not path.is_dir():
        raise WheelhouseError(f"{flag} {wheelhouse}: no such folder; build one with `make wheelhouse` on a machine "
                              "with network and copy it here with the repository.")
    if not project_wheels(path):
        raise WheelhouseError(f"{flag} {wheelhouse}: holds no {PROJECT} wheel (armor_trl-*.whl); build it with "
                              "`make wheelhouse`.")
    command = install_command(path)
    print(f"installing {PROJECT} from {path} (no index): {' '.join(command)}", flush=True)
    done = run(command)
    if done.returncode != 0:
        raise WheelhouseError(
            f"{flag} {wheelhouse}: `pip install --no-index` failed (exit {done.returncode}, pip's message above): "
            "this machine lacks a package the wheelhouse does not hold. Add it with `make wheelhouse "
            "WHEELHOUSE_EXTRA='name==version'` (wheels for Linux x86_64) and copy the wheelhouse again.")
    missing = missing_modules()
    if missing:
        raise WheelhouseError(f"after installing from {wheelhouse}, still not importable: {', '.join(missing)}.")


def ensure_dependencies(wheelhouse: str | os.PathLike | None, flag: str = "--wheelhouse") -> bool:
    """Install from ``wheelhouse`` when one is given; without one, require every module to be importable already
    (no install is attempted: these machines have no network). Returns whether an install ran."""
    if wheelhouse is not None:
        install(wheelhouse, flag)
        return True
    missing = missing_modules()
    if missing:
        raise WheelhouseError(
            f"not importable here: {', '.join(missing)}. On a machine with network run `make wheelhouse`, copy "
            f"the wheelhouse/ folder along with the repository and pass {flag} wheelhouse (pip installs from it "
            "with --no-index; nothing is fetched from the network).")
    return False


# --- build (here, with network) ---------------------------------------------------------------------------------
def pinned(names, lock: str | os.PathLike = LOCK) -> list[str]:
    """``name==version`` of each package as the lock pins it (the versions the tests ran with: `make install`
    installs exactly the lock)."""
    locked = read_lock(lock)
    missing = [name for name in names if canonical(name) not in locked]
    if missing:
        raise WheelhouseError(f"{', '.join(missing)} not in {lock}: add them to requirements/dev.in and run `make lock`.")
    return [f"{name}=={locked[canonical(name)]}" for name in names]


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.whl")) / 2**20


def build(dest: str | os.PathLike, extra=(), max_mib: float = MAX_MIB, python_versions=PYTHON_VERSIONS,
          deepspeed: bool = False) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # only wheels: never a folder the user pointed at by mistake
        old.unlink()
    pip = [sys.executable, "-m", "pip"]
    # the project's own wheel, built with this environment's setuptools (no build isolation: no download)
    built = run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest),
                            str(REPO)], capture_output=True, text=True)
    if built.returncode != 0:  # setuptools' deprecation notices are noise unless the build failed
        raise WheelhouseError(f"building the {PROJECT} wheel failed:\n{built.stdout}{built.stderr}")
    wanted = pinned(WHEELS + FALLBACKS + (DEEPSPEED_WHEELS if deepspeed else ())) + list(extra)
    if deepspeed:  # no wheel on the index: built from its source distribution, without its compiled ops
        built = run([*pip, "wheel", "--quiet", "--no-deps", "--no-binary", DEEPSPEED, "--wheel-dir", str(dest),
                     *pinned([DEEPSPEED])], capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        if built.returncode != 0:
            raise WheelhouseError(f"building the {DEEPSPEED} wheel failed:\n{built.stdout}{built.stderr}")
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    for python in python_versions:  # --no-deps: exactly this list; `check` proves it complete
        run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
                        "--implementation", "cp", "--python-version", python, *platforms, *wanted], check=True)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    total = size_mib(dest)
    print(f"{dest}: {len(wheels)} wheels, {total:.1f} MiB (limit {max_mib:g} MiB)")
    for name in wheels:
        print(f"  {name}")
    if total > max_mib:
        largest = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)[:3]
        raise WheelhouseError(f"{dest} is {total:.1f} MiB, over the {max_mib:g} MiB limit; largest: "
                              + ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in largest)
                              + ". Fewer --extra wheels, or only the GPU machine's CPython (WHEELHOUSE_PYTHONS).")
    return dest


# --- check (here: a scratch venv that looks like the GPU image) ----------------------------------------------------
def check(wheelhouse: str | os.PathLike, pins=(), keep: str | None = None) -> None:
    """Scratch venv with :data:`IMAGE` only (at this environment's versions, ``pins`` overriding), then
    ``pip install --no-index`` from the wheelhouse, the imports and ``armor-trl --help``, outside the checkout."""
    wheelhouse = Path(wheelhouse).resolve()
    if not project_wheels(wheelhouse):
        raise WheelhouseError(f"{wheelhouse} holds no {PROJECT} wheel: run `make wheelhouse` first.")
    overrides = {p.split("==")[0].lower(): p for p in pins}
    image = [overrides.pop(p.split("==")[0].lower(), p) for p in pinned(IMAGE)] + list(overrides.values())
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="wheelhouse-check-"))
    venv, start = root / "venv", time.time()
    try:
        run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        print(f"scratch venv {venv}: installing the image's packages from the index: {' '.join(image)}", flush=True)
        run([python, "-m", "pip", "install", "--quiet", *image], check=True)
        # only the wheelhouse: no index, and none of this machine's pip settings (find-links, extra indexes)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        done = run(install_command(wheelhouse, python), env=env, cwd=root)
        if done.returncode != 0:
            raise WheelhouseError(f"pip install --no-index from {wheelhouse} failed in a venv holding only "
                                  f"{', '.join(IMAGE)}: the wheelhouse misses a package (pip's message above).")
        probe = ("import armor_trl, trl, datasets, math_verify; from armor_trl import ArmorGRPOTrainer; "
                 "from armor_trl.rewards import math_verify_reward as r; "
                 "assert r(['so 72\\n#### 72', '\\\\boxed{71}'], answer=['72', '72']) == [1.0, 0.0]; "
                 "assert '/site-packages/' in armor_trl.__file__, armor_trl.__file__; "
                 "print('imports OK: armor_trl', armor_trl.__version__, 'trl', trl.__version__, "
                 "'datasets', datasets.__version__)")
        run([python, "-c", probe], check=True, env=env, cwd=root)  # cwd outside the checkout
        run([str(venv / "bin" / "armor-trl"), "--help"], check=True, env=env, cwd=root,
                       stdout=subprocess.DEVNULL)
        print(f"wheelhouse check passed in {time.time() - start:.0f} s: {wheelhouse} completes a venv holding only "
              f"{', '.join(IMAGE)} (+ their dependencies); `armor-trl --help` runs.")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="wheelhouse.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels into DEST (here, with network)")
    b.add_argument("--dest", default="wheelhouse")
    b.add_argument("--extra", nargs="*", default=[], help="more NAME==VERSION wheels (Linux x86_64, CPython "
                   f"{'/'.join(PYTHON_VERSIONS)}), e.g. a pyarrow the GPU image lacks")
    b.add_argument("--max_mib", type=float, default=MAX_MIB)
    b.add_argument("--deepspeed", action="store_true", help="also DeepSpeed (built here, pure Python) and "
                   f"{', '.join(DEEPSPEED_WHEELS)} at the lock's versions, for `accelerate launch` with DeepSpeed")
    b.add_argument("--python_versions", nargs="+", default=list(PYTHON_VERSIONS),
                   help="CPython versions to fetch version-specific wheels for (default: %(default)s); one version "
                   "keeps a large --extra (pyarrow: 52.5 MiB per version) under the limit")
    c = sub.add_parser("check", help="install from the wheelhouse alone into a scratch venv holding only the image")
    c.add_argument("--wheelhouse", default="wheelhouse")
    c.add_argument("--pin", nargs="*", default=[], help="NAME==VERSION of an image package (default: this venv's)")
    c.add_argument("--keep", default=None, help="build the scratch venv here and keep it")
    i = sub.add_parser("install", help="pip install --no-index --find-links DIR armor-trl")
    i.add_argument("wheelhouse")
    sub.add_parser("missing", help="exit 1, naming them, if modules the project needs are not importable")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build(args.dest, args.extra, args.max_mib, args.python_versions, args.deepspeed)
        elif args.command == "check":
            check(args.wheelhouse, args.pin, args.keep)
        elif args.command == "missing":
            missing = missing_modules()
            if missing:
                print(f"not importable: {', '.join(missing)}")
            return int(bool(missing))
        else:
            install(args.wheelhouse, flag="wheelhouse")
    except WheelhouseError as error:
        print(f"wheelhouse: error: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"wheelhouse: error: {' '.join(map(str, error.cmd))} exited {error.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
