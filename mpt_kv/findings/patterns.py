"""The pattern rule of a known failure, one for every known-failures file (MPT targets, families, a
project's own): an entry's pattern names its failure, not any failure. It may not match the empty
string, must require a literal text of at least MIN_LITERAL characters in every match
(`literal_run`), and may not match any line of `generic_failures()` (what the suite prints for a
crash with a generic error, or a check's header with no finding). A pattern that matched those
would xfail a different failure than the one it was written for.
"""

from __future__ import annotations

import re

from mpt_kv.checks import index


def compile_pattern(value: str, bad) -> re.Pattern:
    """The entry's regular expression, which must name a failure, not any failure: it may not
    match the empty string, must require a literal text of at least MIN_LITERAL characters in every
    match (`literal_run`), and may not match any line of GENERIC_FAILURES (what the suite prints for
    a crash with a generic error, or a check's header with no finding). The one rule of every
    known-failures file (MPT targets, families, a project's own)."""
    try:
        pattern = re.compile(value)
    except re.error as e:
        raise bad(f"'pattern' {value!r} is not a regular expression: {e}") from None
    if pattern.search(""):
        raise bad(f"'pattern' {value!r} matches the empty string, so any message: name the failure")
    run = literal_run(value)
    if run < MIN_LITERAL:
        raise bad(f"'pattern' {value!r} requires a literal text of only {run} characters in a match, fewer "
                  f"than {MIN_LITERAL}: it would match failures it does not name; quote the failure's message")
    generic = next((line for line in generic_failures() if pattern.search(line)), None)
    if generic is not None:
        raise bad(f"'pattern' {value!r} matches a generic failure that names no finding ({generic!r}): quote "
                  f"what is specific to the failure (the finding, or the exception's own message)")
    return pattern


# A known failure's pattern quotes its message: the shortest literal every shipped pattern requires
# is 15 characters ("') is a view of "' in the MPT P3 entries); the generic words a pattern must not stop at
# ("error", "failed", "Traceback", "P3 cache", "is a view") are shorter.
MIN_LITERAL = 12


def literal_run(value: str) -> int:
    """The length of the longest run of literal characters that every match of the regular
    expression `value` contains (an alternation: the shortest over its branches; an optional or
    repeated-from-zero part: none), from its parse tree."""
    try:
        import re._parser as sre_parse
        from re import _constants as sre
    except ImportError:  # Python < 3.11
        import sre_constants as sre
        import sre_parse
    zero_width = {sre.AT, sre.ASSERT, sre.ASSERT_NOT}

    def seq(items):  # -> (whole, prefix, suffix, best); whole: the length when all literal, else None
        whole, pre, suf, best = 0, 0, 0, 0
        for op, av in items:
            w, p, s, b = node(op, av)
            if whole is not None:
                pre = whole + (w if w is not None else p)
            best = max(best, b, suf + p)
            suf = suf + w if w is not None else s
            whole = whole + w if whole is not None and w is not None else None
        best = max(best, pre, suf)
        return whole, pre if whole is None else whole, suf, best

    def node(op, av):
        if op is sre.LITERAL:
            return 1, 1, 1, 1
        if op is sre.IN and len(av) == 1 and av[0][0] is sre.LITERAL:  # [.] is the literal .
            return 1, 1, 1, 1
        if op in zero_width:
            return 0, 0, 0, 0
        if op is sre.SUBPATTERN:
            return seq(av[-1])
        if getattr(sre, "ATOMIC_GROUP", None) is not None and op is sre.ATOMIC_GROUP:
            return seq(av)
        if op is sre.BRANCH:
            parts = [seq(branch) for branch in av[1]]
            wholes = {w for w, *_ in parts}
            return (wholes.pop() if len(wholes) == 1 else None if None in wholes else min(wholes),
                    *(min(part[i] for part in parts) for i in (1, 2, 3)))
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
            low, high, sub = av
            if low == 0:
                return None, 0, 0, 0
            w, p, s, b = seq(sub)
            if w is not None and low == high:
                return w * low, w * low, w * low, w * low
            return None, p, s, max(b, s + p if low > 1 else 0)
        return None, 0, 0, 0  # any character, a class, a category, a back reference

    return seq(sre_parse.parse(value))[3]


def generic_failures() -> tuple[str, ...]:
    """What the suite's checks print for a failure that names no finding, filled with neutral
    values: the crash wrappers with a generic error (mpt_kv/checks/programs.py run_op,
    mpt_kv/checks/family_driver.py call), the headers of the aliasing and memory checks, an
    assert_close (mpt_kv/checks/compare.py) of neutral tensors, and bare words. A pattern that
    matches one of them would xfail a different failure than the one it was written for."""
    global _GENERIC
    if _GENERIC:
        return _GENERIC
    crashes = [f"{t}: {t in ('KeyError',) and repr('boom') or 'boom'}" for t in
               ("RuntimeError", "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError",
                "AssertionError", "ZeroDivisionError", "NotImplementedError")]
    ops = {"decode": "decode", "extend": "extend 2", "crop": "crop -1", "reorder": "reorder [1, 0]"}
    mpt = ["ops-P1", "ops-P2 (concat)", "ops-P2 (static)", "ops-P2 (fp32 twin)", "ops-P3", "ops-memory"]
    family = ["family-P0", "family-P1", "family-P2", "family-P3", "family-P4", "family-ops", "family-memory"]
    lines = ["error", "failed", "AssertionError", "Traceback (most recent call last)", "PropertyFailure",
             "x differ at 1 of 2 elements (bound 1.000e-05 = 1e-05 + 1e-05 x max|expected|, float32 logits): "
             "max abs err 1.000e+00 = 1e+05 x bound at (0,) (got 1, expected 0); max rel err 1.000e+12 at (0,); "
             "shape (2,) [step=0]",
             "x: shape (2,) != expected (3,) [step=0]",
             "x: NaN/inf appeared (got: 1 NaN, 0 inf of 2 compared elements, first at (0,)); shape (2,) [step=0]",
             "P3 cache aliasing after step prefill: x [step=prefill]",
             "ops-P3 cache aliasing after decode (step 0): x [step=0]",
             "family-P3 cache pins storage after prefill: x [step=prefill, operation=prefill]",
             "family-memory after prefill: the cache's distinct storages hold 2 bytes, the family's analytic K/V "
             "for 1 x 1 tokens 1: +1 bytes; x [step=prefill, operation=prefill]",
             "ops-memory decode: transient 2 bytes > bound 1 bytes: x [operation=decode]"]
    lines += [f"{p}: raised while running the target [step=0]" for p in index.NAMES]
    for crash in crashes:
        for kind, described in ops.items():
            lines += [f"{what}: the target's {kind} raised {crash} at step 0 ({described}) "
                      f"[step=0, operation={kind}]" for what in mpt]
        for operation in ("prefill", "decode", "extend", "crop", "reorder", "logits"):
            lines += [f"{check}{what}: the implementation's {operation} raised {crash} "
                      f"[step=0, operation={operation}]"
                      for check in family for what in ("", " prefill", " decode 0")]
    # the generate checks (mpt_kv/checks/generate.py): a crash of generate in or between calls, and the headers
    # of a cache a call received or returned, a call's logits, the cache kept after generate, with no finding
    for check in [f"generate/{path}/{mode}" for path in ("concat", "static") for mode in index.GENERATE_MODES]:
        lines += [f"{check}: the implementation's generate raised {crash}{at} [step=call 0 (prefill)]"
                  for crash in crashes for at in (" in call 0 (prefill)", " between calls, after call 0 (prefill)",
                                                  " before its first call")]
        lines += [f"{check} call 0 (prefill): the cache it {how} x [step=call 0 (prefill)]" for how in ("received",
                                                                                                     "returned")]
        lines += [f"{check} after generate returned: 1 cache storages it made are still alive, 1 bytes: x "
                  "[step=after generate]"]
    _GENERIC = tuple(lines)
    return _GENERIC


_GENERIC: tuple[str, ...] = ()
