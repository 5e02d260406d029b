"""What is installed, read in one place: the built-in targets and the packages they wrap (the
package map), and the versions of those packages.

No torch and no transformers import here: the versions come from the distributions' metadata
(`importlib.metadata`), so the pytest plugin can read them before a worker's card is pinned, and
a version is the installed distribution's even where importing the package would fail.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version


@dataclass(frozen=True)
class Builtin:
    """A built-in target: where its factory is, which distributions must be installed for it to run
    (absent: its cases skip; installed but not loading: they fail), and which name its version."""

    factory: str
    requires: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()
    install: str = ""  # how to install what it requires (named where it is missing)


BUILTIN = {
    "reference": Builtin("mpt_kv.targets.reference:build"),
    "transformers": Builtin("mpt_kv.targets.hf:build", ("transformers",), ("transformers",)),
    "optimum-habana": Builtin("mpt_kv.targets.gaudi:build", ("optimum-habana",), ("optimum-habana", "transformers")),
    # MosaicML's own MPT (what the Hub's mosaicml/mpt-* run with trust_remote_code), attn_impl torch (flash: the
    # factory mpt_kv.targets.foundry:build_flash, CUDA with flash_attn only)
    "llm-foundry": Builtin("mpt_kv.targets.foundry:build", ("llm-foundry",), ("llm-foundry", "transformers"),
                           "pip install --no-deps llm-foundry einops catalogue tabulate, with its pinned transformers; "
                           "or tox -e foundry"),
}
# the family implementations (mpt_kv.families.implementations) are built-in targets of the same names


def split_attention(implementation: str) -> tuple[str, str | None]:
    """A family target's implementation part as named (`mpt_kv.targets.FamilyTarget.name`): 'transformers[sdpa]'
    -> ('transformers', 'sdpa'), transformers' implementation with that attention implementation (its
    attention axis: mpt_kv.families.implementations.ATTENTION); 'transformers' -> ('transformers', None)."""
    base, bracket, rest = implementation.partition("[")
    if not bracket:
        return implementation, None
    return base, rest.removesuffix("]")


def with_attention(implementation: str, attention: str | None) -> str:
    """The name of `implementation` with `attention` ('transformers', 'sdpa' -> 'transformers[sdpa]')."""
    return implementation if attention is None else f"{implementation}[{attention}]"


def builtin_of(spec: str) -> Builtin | None:
    """The built-in target a spec names: itself, or a family implementation's (`transformers[sdpa]/gpt2/mha`:
    transformers)."""
    return BUILTIN.get(split_attention(spec.split("/", 1)[0])[0])


@functools.lru_cache(maxsize=None)
def installed(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None (read once per process: a metadata lookup
    costs milliseconds, and a session is built per check)."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def missing(spec: str) -> str | None:
    """For a built-in target (or a family implementation, `transformers/<family>`): why it cannot
    run here because a distribution it wraps is not installed; None otherwise."""
    builtin = builtin_of(spec)
    for dist in builtin.requires if builtin else ():
        if installed(dist) is None:
            return f"{dist} is not installed" + (f" ({builtin.install})" if builtin.install else "")
    return None


def target_version(spec: str) -> str:
    """'transformers 5.24', 'optimum-habana 1.21, transformers 4.55', '' (the reference, a user's
    target): the major.minor of what a built-in target (or `<implementation>/<family>`) wraps."""
    builtin = builtin_of(spec)
    out = []
    for dist in builtin.versions if builtin else ():
        v = installed(dist)
        out.append(f"{dist} {'.'.join(v.split('.')[:2]) if v else '?'}")
    return ", ".join(out)


def mpt_kv() -> str:
    """This mpt-kv's version, from its distribution's metadata ('0.1.0'): what a report names as the
    mpt-kv that judged a run. A folder imported without ever being installed has none: said so."""
    return installed("mpt-kv") or "unknown (mpt_kv imported without its distribution metadata: pip install it)"


def transformers_version() -> str:
    return installed("transformers") or "0"


def transformers_major() -> int:
    """4 or 5: the releases whose cache APIs differ (Cache objects, crop, StaticCache's constructor)."""
    return int(transformers_version().split(".")[0])


def optimum_habana_release() -> str:
    """'optimum-habana 1.21.2', for messages."""
    v = installed("optimum-habana")
    return f"optimum-habana {v}" if v else "optimum-habana (no distribution metadata)"


def versions_match(when: dict) -> bool:
    """Every distribution of `when` ({dist: packaging SpecifierSet}) is installed, in a version its
    specifier contains (a known failure's `when`)."""
    for dist, spec in when.items():
        v = installed(dist)
        if v is None or not spec.contains(v, prereleases=True):
            return False
    return True
