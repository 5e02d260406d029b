"""optimum-habana's `GaudiMptForCausalLM`, in its concat path (no `token_idx`) and its static
`token_idx` path (with and without `cache_idx` buckets).

On a Gaudi machine it is imported normally and `adapt_transformers_to_gaudi()` swaps the
classes. Elsewhere `import optimum.habana` fails (its `__init__` checks the Synapse version
and its models package imports habana_frameworks), but the MPT module itself guards its one
HPU import and runs on CPU: `load_gaudi_mpt_module` registers the parent packages as bare
namespace modules so their `__init__` never runs, then imports just that module (measured on 1.21.2).

Every release with an MPT loads (1.7.3 to 1.21.2): `gaudi_classes` applies what that release's
`adapt_transformers_to_gaudi` does to transformers' MPT module, parsed from its own
modeling_utils.py (`mpt_patches`), whether it replaces classes (1.14 and later) or sets
functions on them (`MptAttention.forward = gaudi_mpt_attention_forward`, 1.7.3 to 1.13.x).

Public API (docs/targets.md): `load_gaudi_mpt_module()` returns optimum-habana's MPT module,
on CPU too (TargetUnavailable with the reason where it cannot); `gaudi_classes(module)` is the
context in which `module.GaudiMptForCausalLM(config)` builds Gaudi blocks. A fork of
optimum-habana installed in its place loads the same way. `GaudiStyleRunner` (defined in
`mpt_kv.targets.wrappers`, imported here too) drives any model with the same forward signature.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import sys
import types
from pathlib import Path

from mpt_kv import versions
from mpt_kv.errors import TargetUnavailable
from mpt_kv.targets import Capabilities
from mpt_kv.targets.wrappers import GaudiStyleRunner, GaudiStyleSession  # noqa: F401  (public here too)

__all__ = ["load_gaudi_mpt_module", "gaudi_classes", "GaudiStyleRunner", "GaudiStyleSession", "build"]

MPT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"


def optimum_habana_root() -> Path:
    """The installed optimum-habana's `optimum/habana` folder; TargetUnavailable "optimum-habana is
    not installed" (the only message that means the package is absent) where there is none."""
    spec = importlib.util.find_spec("optimum")
    root = next((Path(p) / "habana" for p in (spec.submodule_search_locations or []) if (Path(p) / "habana").is_dir()),
                None) if spec else None
    if root is None:
        raise TargetUnavailable("optimum-habana is not installed (pip install --no-deps optimum-habana, "
                                "or tox -e ohabana)")
    return root


def module_file(root: Path, name: str) -> Path:
    """Where optimum-habana's module `name` (optimum.habana.x.y) lies under `root` (optimum/habana)."""
    return root.joinpath(*name.split(".")[2:]).with_suffix(".py")


def register_bare_parents(root: Path, name: str) -> None:
    """Register every parent package of `name` under optimum.habana as a bare namespace module
    (its folder as __path__, its __init__ never run), where it is not imported yet."""
    parts = name.split(".")
    for depth in range(2, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            pkg = types.ModuleType(package)
            pkg.__path__ = [str(root.joinpath(*parts[2:depth]))]
            sys.modules[package] = pkg


def load_gaudi_mpt_module():
    """optimum-habana's MPT module (GaudiMptForCausalLM), on HPU or CPU.

    TargetUnavailable says why not. Only "optimum-habana is not installed" means the package is
    absent; every other message is a package that is installed but does not load, which the
    plugin reports as an error, never as a skip. Where habana_frameworks imports, the module is
    imported normally, and its failure is reported as it is (it is not "needs HPU")."""
    if MPT_MODULE in sys.modules:
        return sys.modules[MPT_MODULE]
    root = optimum_habana_root()
    if not (root / "transformers" / "models" / "mpt" / "modeling_mpt.py").is_file():
        raise TargetUnavailable(f"{release()} has no MPT: {root / 'transformers' / 'models' / 'mpt' / 'modeling_mpt.py'} "
                                "does not exist (optimum-habana's MPT came in 1.7.x)")
    if importlib.util.find_spec("habana_frameworks") is not None:
        # an HPU stack is installed: the normal import path, and any failure is the real one
        try:
            import habana_frameworks.torch  # noqa: F401
        except Exception as e:
            raise TargetUnavailable(f"habana_frameworks is installed but does not import ({type(e).__name__}: {e}), "
                                    f"so {MPT_MODULE} cannot be loaded either") from e
        try:
            return importlib.import_module(MPT_MODULE)
        except Exception as e:
            raise TargetUnavailable(f"optimum-habana is installed and habana_frameworks imports, but {MPT_MODULE} "
                                    f"fails to import: {type(e).__name__}: {e}") from e
    # CPU: its package __init__ files need HPU (a Synapse version check, habana_frameworks imports); the MPT module itself does not
    register_bare_parents(root, MPT_MODULE)
    with contextlib.redirect_stdout(None):  # it prints one line about FusedSDPA at import
        try:
            return importlib.import_module(MPT_MODULE)
        except Exception as e:
            raise TargetUnavailable(f"optimum-habana is installed but {MPT_MODULE} fails to import on CPU (its parent "
                                    f"packages bypassed, see mpt_kv/targets/gaudi.py): {type(e).__name__}: {e}") from e


# where adapt_transformers_to_gaudi writes into transformers' MPT module
HF_MPT = "transformers.models.mpt.modeling_mpt"


release = versions.optimum_habana_release  # "optimum-habana 1.21.2", for messages


@dataclasses.dataclass(frozen=True)
class MptPatch:
    """One line of `adapt_transformers_to_gaudi` that writes into a transformers module (MPT's
    by default): `transformers.models.mpt.modeling_mpt.<name>[.<attribute>] = <value>`."""

    line: int
    name: str            # MptModel, MptBlock, MptAttention, MptForCausalLM, ...
    attribute: str | None  # forward (function style) or None (the class itself is replaced)
    value: str           # the name assigned, looked up in optimum-habana's module of that model
    hf_module: str = HF_MPT  # the transformers module written into

    def __str__(self):
        target = f"{self.name}.{self.attribute}" if self.attribute else self.name
        return f"modeling_utils.py:{self.line}: {self.hf_module}.{target} = {self.value}"


GaudiPatch = MptPatch  # the same line for any family (mpt_kv.families.gaudi)


def mpt_patches(module) -> list[MptPatch]:
    """What this release's `adapt_transformers_to_gaudi` does for MPT, read from its own
    `optimum/habana/transformers/modeling_utils.py` (parsed, not imported: importing it pulls in
    every other model's code and habana_frameworks). TargetUnavailable, naming the release, where
    the file or its MPT lines cannot be read or applied."""
    return model_patches(module, HF_MPT, "MPT")


def model_patches(module, hf_module: str, label: str, source: Path | None = None) -> list[MptPatch]:
    """`mpt_patches` for the transformers module `hf_module` (`label`: how messages name the
    model, "MPT"): the lines of `adapt_transformers_to_gaudi` that write into it, each value looked
    up in `module` (optimum-habana's module of that model, or a fork of it). `source`: the
    modeling_utils.py to read (default: the one of the release `module` lies in)."""
    path = source or Path(module.__file__).resolve().parents[2] / "modeling_utils.py"
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError) as e:
        raise TargetUnavailable(f"{release()}: cannot read adapt_transformers_to_gaudi from {path} "
                                f"({type(e).__name__}: {e}), so its MPT patches are unknown") from e
    adapt = next((node for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "adapt_transformers_to_gaudi"), None)
    if adapt is None:
        raise TargetUnavailable(f"{release()}: {path} defines no adapt_transformers_to_gaudi")
    patches = []
    for node in ast.walk(adapt):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            dotted = ast.unparse(target)
            if not dotted.startswith(hf_module + "."):
                continue
            parts = dotted[len(hf_module) + 1:].split(".")
            if len(parts) > 2 or not isinstance(node.value, (ast.Name, ast.Attribute)):
                raise TargetUnavailable(f"{release()}: modeling_utils.py:{node.lineno}: the loader cannot apply "
                                        f"'{dotted} = {ast.unparse(node.value)}' (it applies a class or a "
                                        f"class attribute set to a name of the {label} module)")
            value = ast.unparse(node.value).rsplit(".", 1)[-1]
            patches.append(MptPatch(node.lineno, parts[0], parts[1] if len(parts) == 2 else None, value, hf_module))
    if not patches:
        raise TargetUnavailable(f"{release()}: adapt_transformers_to_gaudi in {path} patches nothing of "
                                f"{hf_module}: this release has no Gaudi {label}")
    patches.sort(key=lambda p: p.line)
    # a name modeling_utils.py imported under another (`from .models.deepseek_v2.modeling_deepseek_v2 import
    # DeepseekV2ForCausalLM as GaudiDeepseekV2ForCausalLM`, optimum-habana 1.21.2 :336): the module's own name
    aliases = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for a in node.names if a.asname}
    patches = [dataclasses.replace(p, value=aliases[p.value]) if not hasattr(module, p.value) and p.value in aliases else p
               for p in patches]
    for p in patches:
        if not hasattr(module, p.value):
            raise TargetUnavailable(f"{release()}: {p}: {module.__name__} has no {p.value!r}")
    return patches


# (the module object, patches) -> {name: class}: the same classes for every build of that module;
# keyed by the module itself, not its name or file, which a reloaded or substituted module shares
_patched: dict[tuple, dict] = {}


def patched_classes(module, patches: list[MptPatch]) -> dict:
    """transformers MPT name -> what it is while a model is built. A replaced class is the Gaudi
    class; a patched attribute (`MptBlock.forward = gaudi_mpt_block_forward`) goes on a subclass
    of transformers' class, so transformers' own classes stay untouched for other targets."""
    key = (module, tuple(patches))
    if key in _patched:
        return _patched[key]
    hf_module = patches[0].hf_module if patches else HF_MPT
    hf = importlib.import_module(hf_module)
    classes = {}
    for p in patches:
        value = getattr(module, p.value)
        if p.attribute is None:
            classes[p.name] = value
            continue
        base = classes.get(p.name, getattr(hf, p.name, None))
        if not isinstance(base, type):
            raise TargetUnavailable(f"{release()}: {p}: transformers {hf_version()} has no class {p.name} in {hf_module}")
        classes[p.name] = type(f"Gaudi{base.__name__}" if not base.__name__.startswith("Gaudi") else base.__name__,
                               (base,), {p.attribute: value, "__module__": module.__name__})
    _patched[key] = classes
    return classes


hf_version = versions.transformers_version


@contextlib.contextmanager
def gaudi_classes(module, patches: list[MptPatch] | None = None):
    """The context in which `module.GaudiMptForCausalLM(config)` builds Gaudi blocks: what this
    release's `adapt_transformers_to_gaudi` does to transformers' MPT module (`mpt_patches`:
    class-style releases replace MptModel, MptBlock and MptAttention, function-style ones such as
    1.12.1 set `MptAttention.forward` and `MptBlock.forward`), undone on exit. `patches`: another
    model's lines (`model_patches`), applied to their own transformers module the same way."""
    patches = mpt_patches(module) if patches is None else patches
    hf = importlib.import_module(patches[0].hf_module if patches else HF_MPT)
    classes = patched_classes(module, patches)
    saved = {n: getattr(hf, n) for n in classes if hasattr(hf, n)}
    try:
        for n, cls in classes.items():
            setattr(hf, n, cls)
        yield
    finally:
        for n in classes:
            if n in saved:
                setattr(hf, n, saved[n])
            else:
                delattr(hf, n)


def reads_attribute(function, name: str) -> bool:
    """Whether `function`'s code (or code nested in it) reads the attribute or name `name`."""
    codes = [getattr(inspect.unwrap(function), "__code__", None)]  # under decorators (deprecate_kwarg in 5.x)
    while codes:
        code = codes.pop()
        if code is None:
            continue
        if name in code.co_names or name in code.co_consts:
            return True
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


def release_capabilities(model) -> Capabilities:
    """What this release's attention lacks that its forward signature does not show: a release
    whose attention forward never reads `clip_qkv` (1.12.1 and older) does not implement it."""
    attn = type(model.transformer.blocks[0].attn)
    if reads_attribute(attn.forward, "clip_qkv"):
        return Capabilities()
    return Capabilities({"clip_qkv": f"{release()}: {attn.__name__}.forward never reads clip_qkv (mixed_qkv is "
                                     "not clamped)"})


def build(cfg, state_dict, device, dtype):
    module = load_gaudi_mpt_module()
    with gaudi_classes(module):
        model = module.GaudiMptForCausalLM(cfg.to_hf())
    model.load_state_dict(state_dict, strict=True)
    model.to(device=device, dtype=dtype).eval()
    runner = GaudiStyleRunner(model, device, capabilities=release_capabilities(model))
    runner.version = release()
    return runner


def recipe_target(name: str):
    """The optimum-habana target driven with one of optimum-habana's text-generation recipes
    (`mpt_kv.recipes.RECIPES`, the one definition the ports' driver reads too, mpt_kv/families/gaudi.py): every
    cached forward gets the recipe's flags that MPT's forward names (what its prepare_inputs_for_generation
    passes on), the rest recorded as dropped on the runner (`recipe_dropped`). A factory, as `build`."""
    from mpt_kv import recipes

    recipe = recipes.RECIPES[name]  # KeyError naming the recipes for an unknown one

    def factory(cfg, state_dict, device, dtype):
        runner = build(cfg, state_dict, device, dtype)
        takes = inspect.signature(runner.model.forward).parameters.__contains__
        runner.forward_kwargs = recipe.forward_kwargs(takes)
        runner.recipe, runner.recipe_dropped = recipe, recipe.dropped(takes)
        return runner

    factory.__qualname__ = factory.__name__ = f"recipe_target({name!r})"
    return factory


# The seed PR's command (`--trim_logits --attn_softmax_bf16 --limit_hpu_graphs`, bf16, static shapes; no
# reuse_cache: generate refuses it for MPT): none of its flags reaches MPT's forward (its runner says so), so its
# runs are the static path's, as on Gaudi; `python -m mpt_kv devicecheck`'s seed-gaudi step benches it
seed = recipe_target("seed")

