"""Compare the installed packages with a lock file of `name==version` lines (pip -c format).

    python constraints/diff.py constraints/cpu.txt           # print what differs (the `latest` env)
    python constraints/diff.py constraints/cpu.txt --check   # ... and exit 1 if a pinned one differs
    python constraints/diff.py constraints/cpu.txt --write   # rewrite the lock from this environment

The tox envs install from these locks (PIP_CONSTRAINT), so no upstream release can turn the gate
red or green without a commit here; `tox -e latest` installs the newest releases instead and
prints this diff. Upgrading is a commit: run `tox -e latest`, then `--write` from its env, record
ceilings for new versions locally (`--update-ceilings`), and commit both. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import distributions
from pathlib import Path

# tooling that is not part of what is tested, and this package itself
IGNORED = {"pip", "setuptools", "wheel", "mpt-kv"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    return version.split("+", 1)[0]  # torch 2.13.0+cpu: the local label names the build, not the release


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): public(d.version) for d in distributions()
            if d.metadata["Name"] and canonical(d.metadata["Name"]) not in IGNORED}


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{path}: {line!r} is not a name==version pin")
            pins[canonical(name)] = version.strip()
    return pins


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lock", type=Path)
    p.add_argument("--check", action="store_true", help="exit 1 if a pinned package is installed at another version")
    p.add_argument("--write", action="store_true", help="rewrite LOCK from this environment")
    a = p.parse_args(argv)
    have = installed()
    if a.write:
        header = [line for line in a.lock.read_text().splitlines() if line.startswith("#")] if a.lock.exists() else []
        a.lock.write_text("\n".join([*header, *(f"{n}=={v}" for n, v in sorted(have.items()))]) + "\n")
        print(f"wrote {a.lock}: {len(have)} pins")
        return 0
    pins = read_lock(a.lock)
    changed = [f"  {n}: {pins[n]} (locked) -> {have[n]} (installed)" for n in sorted(pins) if n in have and have[n] != pins[n]]
    new = [f"  {n} {have[n]} (not in the lock)" for n in sorted(set(have) - set(pins))]
    print(f"{a.lock} vs this environment: {len(changed)} changed, {len(new)} not locked")
    print("\n".join(changed + new) or "  identical")
    return 1 if a.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
