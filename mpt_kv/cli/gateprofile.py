"""`python -m mpt_kv gateprofile`: the stored gate profile (mpt_kv/catalogue/gate_profile.py).

    python -m mpt_kv gateprofile            # what the stored profile selects, and whether it is current
    python -m mpt_kv gateprofile --check    # exit 1 when it is stale (the catalogue changed since --update)
                                            # or edited (its parts differ from the digests --update wrote)
    python -m mpt_kv gateprofile --update --jobs 2   # recompute it from the catalogues (minutes) and rewrite it

Exit status: 0 current (or rewritten), 1 stale, edited, missing or malformed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from mpt_kv.catalogue import gate_profile
from mpt_kv.outputs import file_problem, path_arg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpt_kv gateprofile", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when the stored profile is stale or edited (cheap: no check runs)")
    mode.add_argument("--update", action="store_true",
                      help=f"recompute the profile from the catalogues and rewrite {gate_profile.PROFILE_FILE.name}")
    parser.add_argument("--out", metavar="FILE", type=path_arg, default=None,
                        help="with --update: write the profile here instead of the package's file")
    parser.add_argument("-j", "--jobs", type=int, default=1, metavar="N", help="--update in N processes (cpu)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more processes")
    if args.out is not None and not args.update:
        parser.error("--out is where --update writes: give --update")
    out = args.out if args.out is not None else gate_profile.PROFILE_FILE
    if args.update:
        problem = file_problem(str(out))
        if problem:
            parser.error(f"{out}: {problem}")
        data = gate_profile.compute(args.jobs, progress=lambda line: print(line, file=sys.stderr, flush=True))
        gate_profile.write(data, out)
        print(f"{out}: {len(data['cases'])} cases of {data['candidates']} kill {len(data['killers'])} variants "
              f"({len(data['waiting'])} waiting); the reference runs them in {data['reference_seconds']['gate']} s "
              f"of {data['reference_seconds']['all candidates']} s ({data['seconds']} s to compute)")
        return 0
    try:
        profile = gate_profile.load()
    except gate_profile.ProfileError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print(f"gate profile ({gate_profile.PROFILE_FILE.name}): {len(profile.cases)} cases; {profile.data['rule']}")
    for c in profile.data["cases"]:
        meets = f"; meets {', '.join(c['meets'])}" if c.get("meets") else ""
        print(f"  {c['check']} [{c['dtype']}]: kills {len(c['kills'])} ({', '.join(c['kills'])}){meets}")
    if profile.waiting:
        print(f"  waiting (no check kills them yet): {', '.join(profile.waiting)}")
    for requirement, why in profile.data.get("gives_up", {}).items():
        print(f"  gives up {requirement}: {why}")
    reason = gate_profile.stale_reason(profile)
    if reason:
        print(f"FAIL: {reason}", file=sys.stderr)
        return 1
    print("current: it matches the installed catalogue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
