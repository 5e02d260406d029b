"""MosaicML's own MPT: llm-foundry's `MPTForCausalLM`, what the Hub's mosaicml/mpt-* checkpoints run
with `trust_remote_code=True` (a snapshot of these files), and what trains and fine-tunes MPT.

What is loaded, and what stands in (docs/targets.md, "llm-foundry"):

- llm-foundry's own files, as released: `llmfoundry/models/mpt/{configuration_mpt,modeling_mpt}.py`
  and what they import (`llmfoundry/models/layers/*.py`, `llmfoundry/models/utils/*.py`,
  `llmfoundry/layers_registry.py`, `llmfoundry/utils/registry_utils.py`), unchanged, on the installed
  torch and transformers. The package `__init__` files are not run: they import the training stack
  (composer, streaming, mlflow, ...). The parents are registered as bare packages (their folder as
  `__path__`), as the optimum-habana loader does (`mpt_kv/targets/gaudi.py`).
- `modeling_mpt.py` imports `composer` (`HuggingFaceModel`, `dist`; older releases also
  `composer.metrics`, `omegaconf` and, through llmfoundry.metrics, `torchmetrics`) at module level for its
  training wrapper `ComposerMPTCausalLM`.
  Where composer (or omegaconf) is not installed, a stand-in is in `sys.modules` while that file is
  imported, and removed after: every name of it is a class or module that raises `TargetBroken` when
  it is called, instantiated or read further, so the model code cannot run any of it unnoticed (the
  one use in `MPTModel.__init__`, `dist.get_local_rank()`, is reached only with
  `init_device='mixed'`; the target builds on `cpu`). The stand-in never counts as the model: the
  model is llm-foundry's classes, and `load` refuses a `MPTForCausalLM` defined anywhere but in the
  installed llm-foundry's `modeling_mpt.py`.
- The class is what `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` gives a user:
  transformers' own `add_generation_mixin_to_remote_model(MPTForCausalLM)` (the remote class gains
  `GenerationMixin`; from transformers 4.50 `PreTrainedModel` no longer inherits it).

How generate drives it (transformers 4.51, llm-foundry 0.22's pin `>=4.51,<4.52`; a release outside its
release's pin is refused, `TargetUnavailable`, because generate cannot run its cache there: 4.55's
generate hands the forward an empty `DynamicCache`, which `MPTModel.forward` rejects, `ValueError:
past_key_values must provide a past_key_value for each attention layer`; 5.x's cannot even build one,
`AttributeError: 'MPTConfig' object has no attribute 'num_hidden_layers'`):

- every forward goes through the model's own `prepare_inputs_for_generation(input_ids,
  past_key_values=, attention_mask=, use_cache=True)`, as `_sample`, `_beam_search` and
  `_assisted_decoding` call it; the cache is its legacy tuple, one `(key, value)` per layer;
- decode: one new token; extend (assisted decoding's verification call): the k candidate tokens with
  the mask k longer, the logits of the last k positions (`outputs.logits[:, -candidate_length - 1:]`);
- crop (assisted decoding after rejected candidates): transformers' `_crop_past_key_values(model,
  past_key_values, n)` (generation/utils.py `_assisted_decoding`);
- reorder (beam search): the installed release's route (`mpt_kv.targets.hf_generation`), for 4.51
  `GenerationMixin._temporary_reorder_cache`, which sends a tuple cache to the model's own
  `_reorder_cache`.

Its cache layouts: `attn_impl="torch"` stores K transposed, `(b, h, d, s)`, V `(b, h, s, d)`, grown
by `torch.cat` on dim 3 and 2 (`llmfoundry/models/layers/attention.py`,
`scaled_multihead_dot_product_attention`); `"flash"` stores both `(b, s, h, d)`. `kv()` hands the
checks `(B, H, T, hd)` views of the stored tensors (a transpose: the same storage, so P3, the memory
checks and P2's poison see the stored bytes). No static cache, no `cache_idx` buckets: declared.

Config: the built-in target is mosaicml/mpt-7b's configuration (mpt_kv/data/mpt-7b.json: ALiBi,
`low_precision_layernorm`, no biases, fused Wqkv, multi-head attention, `attn_impl="torch"`) at each
case's shape, with the case's `clip_qkv`, `alibi_bias_max` and `layer_norm_epsilon`. The fields only
llm-foundry has (`ONLY_FOUNDRY`) take `factory(**fields)`: a value the oracle follows (the same
computation: `fused_qkv=False`, `kv_n_heads` equal to `n_heads`, `softmax_scale` 1/sqrt(head_dim), a
`sliding_window_size` that covers every position, ...) is accepted, any other is an `InputError` naming
the field, because no check could judge it (the reference MPT has no such computation).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import sys
import traceback
import types
from pathlib import Path

import torch

from mpt_kv import versions
from mpt_kv.errors import InputError, StandInError, TargetBroken, TargetUnavailable
from mpt_kv.model.session import Session
from mpt_kv.targets import Capabilities
from mpt_kv.targets.wrappers import ModelRunner

__all__ = ["load", "build", "build_flash", "factory", "FoundryRunner", "FoundrySession", "ONLY_FOUNDRY", "INSTALL"]

DIST = "llm-foundry"
INSTALL = versions.BUILTIN["llm-foundry"].install
MODELING = "llmfoundry.models.mpt.modeling_mpt"
CONFIGURATION = "llmfoundry.models.mpt.configuration_mpt"
# imported first: they fill the registries build_fc / build_norm / the FFN and init builders read
# (without them MPTConfig's validation fails: "Cant't find 'torch' in registry llmfoundry -> fcs")
REGISTRY_MODULES = ("llmfoundry.models.layers.fc", "llmfoundry.models.layers.norm",
                    "llmfoundry.models.layers.ffn", "llmfoundry.models.utils.param_init_fns")
# packages of the training stack modeling_mpt.py imports at module level for ComposerMPTCausalLM
STANDIN_PACKAGES = ("composer", "omegaconf", "torchmetrics")

NO_STATIC = ("llm-foundry's MPT has one cache, a tuple of (key, value) per layer grown by torch.cat "
             "(llmfoundry/models/layers/attention.py:147-151): no preallocated static cache")
NO_BUCKET = "llm-foundry's MPT has no static cache, so no cache_idx buckets"


def release() -> str:
    v = versions.installed(DIST)
    return f"llm-foundry {v}" if v else "llm-foundry (no distribution metadata)"


def package_root() -> Path:
    """The installed `llmfoundry` folder; TargetUnavailable "llm-foundry is not installed" (naming the
    install command) where there is none."""
    loaded = sys.modules.get("llmfoundry")  # registered bare by an earlier load: it has no __spec__
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(list(loaded.__path__)[0])
    spec = importlib.util.find_spec("llmfoundry")
    if spec is None or not spec.submodule_search_locations:
        raise TargetUnavailable(f"llm-foundry is not installed ({INSTALL})")
    return Path(list(spec.submodule_search_locations)[0])


def module_path(root: Path, name: str) -> Path:
    return root.joinpath(*name.split(".")[1:]).with_suffix(".py")


def transformers_pin() -> str | None:
    """The installed llm-foundry's `Requires-Dist` on transformers ('<4.52,>=4.51.0'), None if none."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirements = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:  # its files without distribution metadata: no pin to hold it to
        return None
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() == "transformers" and req.marker is None:
            return str(req.specifier).replace("v", "") or None  # 0.18+ write ">=v4.49.0"
    return None


def check_transformers() -> None:
    """Refuse a transformers outside the release's own pin: generate cannot run this model's cache there
    (module doc), so every cached case would check transformers' incompatibility, not the cache."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    pin, have = transformers_pin(), versions.transformers_version()
    if not pin:
        return
    try:
        spec = SpecifierSet(pin)
    except InvalidSpecifier:
        return
    if not spec.contains(have, prereleases=True):
        raise TargetUnavailable(
            f"{release()} requires transformers {pin} (its Requires-Dist), but transformers {have} is installed: "
            "generate cannot drive its cache there (transformers 4.55 hands MPTModel.forward an empty DynamicCache, "
            "which it rejects; 5.x cannot build a DynamicCache from its MPTConfig). Install the pinned transformers "
            "(tox -e foundry does)")


def register_bare_parents(root: Path, name: str) -> None:
    """Every parent package of `name` as a bare package (its folder as __path__, its __init__ not run)."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(root.joinpath(*parts[1:depth]))]
            sys.modules[package] = module


# --- the stand-in for the training stack --------------------------------------------------------------

class _AbsentType(type):
    """The stand-in's classes: reading any attribute of the class itself (`dist.get_local_rank`) raises too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls.__init__(None)


def _absent(qualname: str):
    def refuse(*args, **kwargs):
        raise StandInError(f"{qualname} is mpt-kv's stand-in for llm-foundry's training stack (not installed), "
                           "which its model code must not use: this code path cannot be checked here")

    return _AbsentType(qualname.rsplit(".", 1)[-1], (), {"__init__": refuse, "__call__": refuse,
                                                         "__mpt_kv_standin__": True,
                                                         "__module__": qualname.rsplit(".", 1)[0]})


class StandInModule(types.ModuleType):
    """A module of the stand-in: any name it is asked for is an `_absent` class."""

    __mpt_kv_standin__ = True
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _absent(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes `import composer.models` (any module under the stand-in packages) a `StandInModule`."""

    def __init__(self, packages):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def training_stack_standin():
    """While llm-foundry's files are imported: the packages of STANDIN_PACKAGES that are not installed
    come from `StandInFinder`; after, they are gone from sys.modules and the finder is removed (what the
    imported module bound stays bound, and raises if used). Installed ones are imported for real."""
    absent = tuple(p for p in STANDIN_PACKAGES if importlib.util.find_spec(p) is None)
    if not absent:
        yield absent
        return
    finder = StandInFinder(absent)
    sys.meta_path.insert(0, finder)
    try:
        yield absent
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in absent]:
            if getattr(sys.modules[name], "__mpt_kv_standin__", False):
                del sys.modules[name]


def import_error(root: Path, name: str, e: BaseException) -> TargetUnavailable:
    """The file and the import that failed, for a release whose files do not load."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if str(root) in f.filename]
    where = f"{Path(frames[-1].filename).relative_to(root.parent)}:{frames[-1].lineno} ({frames[-1].line})" \
        if frames else str(module_path(root, name).relative_to(root.parent))
    return TargetUnavailable(f"{release()}: {name} does not load: {where} raised {type(e).__name__}: {e}")


def load():
    """(modeling_mpt, configuration_mpt): llm-foundry's MPT modules, loaded from the installed release's
    own files without its training stack (module doc). TargetUnavailable with the reason where they
    cannot: "llm-foundry is not installed (<the install command>)", or the file and import that failed."""
    root = package_root()
    check_transformers()
    if MODELING in sys.modules and CONFIGURATION in sys.modules:
        return sys.modules[MODELING], sys.modules[CONFIGURATION]
    modeling = module_path(root, MODELING)
    if not modeling.is_file():
        raise TargetUnavailable(f"{release()} has no MPT model code: {modeling} does not exist")
    register_bare_parents(root, MODELING)
    for name in ("llmfoundry.models.layers", "llmfoundry.models.utils", "llmfoundry.utils"):
        register_bare_parents(root, name + ".x")
    with training_stack_standin():
        for name in (*[m for m in REGISTRY_MODULES if module_path(root, m).is_file()], CONFIGURATION, MODELING):
            try:
                importlib.import_module(name)
            except Exception as e:
                raise import_error(root, name, e) from e
    module = sys.modules[MODELING]
    cls = getattr(module, "MPTForCausalLM", None)
    if cls is None or Path(sys.modules[cls.__module__].__file__).resolve() != modeling.resolve():
        raise TargetUnavailable(f"{release()}: {modeling} defines no MPTForCausalLM of its own")
    return module, sys.modules[CONFIGURATION]


def generation_class(cls):
    """What `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` instantiates: the remote
    class with `GenerationMixin` added by transformers' own `add_generation_mixin_to_remote_model`
    (where the installed transformers has it; before, PreTrainedModel inherits GenerationMixin)."""
    try:
        from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model
    except ImportError:
        return cls
    return add_generation_mixin_to_remote_model(cls)


# --- config ---------------------------------------------------------------------------------------------

# llm-foundry's attention fields transformers' MPT and the reference do not have, each with the values
# the oracle follows (the same computation as the reference's), given the case's ModelConfig
ONLY_FOUNDRY = {
    "fused_qkv": lambda cfg, v: v in (True, False),  # False: Wq, Wk, Wv loaded from the Wqkv rows
    "kv_n_heads": lambda cfg, v: v is None or v == cfg.n_heads,  # GQA with as many KV heads: multi-head
    "attn_type": lambda cfg, v: v in ("multihead_attention", "grouped_query_attention"),
    "softmax_scale": lambda cfg, v: v is None or math.isclose(v, 1 / math.sqrt(cfg.head_dim), rel_tol=1e-12),
    "sliding_window_size": lambda cfg, v: v == -1 or (isinstance(v, int) and v >= cfg.max_seq_len),
    "attn_logit_softcapping": lambda cfg, v: v is None,
    "qk_ln": lambda cfg, v: v is False,
    "qk_gn": lambda cfg, v: v is False,
    "rope": lambda cfg, v: v is False,
    "attn_uses_sequence_id": lambda cfg, v: v is False,
}
ORACLE_HAS = {
    "kv_n_heads": "the reference MPT is multi-head: as many K/V heads as query heads",
    "softmax_scale": "the reference scales scores by 1/sqrt(head_dim)",
    "sliding_window_size": "the reference attends to every earlier position: only a window covering max_seq_len "
                           "(or -1) is the same computation",
    "attn_logit_softcapping": "the reference does not cap its attention logits",
    "qk_ln": "the reference has no layer norm on q and k (and no weights for one)",
    "qk_gn": "the reference has no group norm on q and k",
    "rope": "the reference positions by ALiBi only",
    "attn_uses_sequence_id": "the reference attends across the whole row",
    "attn_type": "the reference is multi-head attention",
    "fused_qkv": "True or False",
}


def check_fields(cfg, fields: dict) -> None:
    """Each llm-foundry-only field is one the oracle follows, or an InputError naming it (never dropped)."""
    for name, value in fields.items():
        if name not in ONLY_FOUNDRY:
            raise InputError(f"llm-foundry field {name}={value!r}: not one mpt-kv can set (the drawn ModelConfig "
                             f"gives the shared ones; llm-foundry-only: {', '.join(ONLY_FOUNDRY)})")
        if not ONLY_FOUNDRY[name](cfg, value):
            raise InputError(f"llm-foundry field {name}={value!r} is refused: {ORACLE_HAS[name]}, so no check could "
                             f"judge this value against the oracle (ModelConfig({cfg.describe()}))")


def mpt_config(configuration, cfg, attn_impl: str = "torch", **fields):
    """llm-foundry's MPTConfig of mosaicml/mpt-7b's configuration at `cfg`'s shape and fields (module doc)."""
    check_fields(cfg, fields)
    # the rest of attn_config are the release's own defaults (softmax_scale None, qk_ln False, ...)
    attn_config = {"attn_impl": attn_impl, "alibi": True, "alibi_bias_max": cfg.alibi_bias_max, "clip_qkv": cfg.clip_qkv}
    top = {"fused_qkv"}
    for name, value in fields.items():
        if name == "kv_n_heads" and value is not None:
            attn_config.setdefault("attn_type", "grouped_query_attention")
        if name == "attn_type" and value == "grouped_query_attention":
            attn_config.setdefault("kv_n_heads", cfg.n_heads)
        if name not in top:
            attn_config[name] = value
    params = configuration.MPTConfig.__init__.__code__.co_varnames
    kwargs = dict(d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
                  max_seq_len=cfg.max_seq_len, expansion_ratio=4, resid_pdrop=0.0, emb_pdrop=0.0,
                  learned_pos_emb=False, attn_config=attn_config, init_device="cpu", logit_scale=None,
                  no_bias=True, embedding_fraction=1.0, norm_type="low_precision_layernorm", use_cache=True,
                  # transformers 5.x's PretrainedConfig no longer defaults them
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if "norm_eps" in params:
        kwargs["norm_eps"] = cfg.layer_norm_epsilon
    elif cfg.layer_norm_epsilon != 1e-5:
        raise TargetUnavailable(f"{release()}: its MPTConfig has no norm_eps (its LayerNorm's eps is torch's 1e-5), "
                                f"so layer_norm_epsilon={cfg.layer_norm_epsilon} cannot be given to it")
    if "fused_qkv" in fields:
        attn_config["fused_qkv"] = fields["fused_qkv"]
    return configuration.MPTConfig(**kwargs)


def foundry_state_dict(state_dict: dict, cfg, fused_qkv: bool = True) -> dict:
    """mpt-kv's weights (transformers' MptForCausalLM names, which are llm-foundry's) for llm-foundry's
    MPTForCausalLM: `lm_head.weight` is tied to `transformer.wte.weight` (llm-foundry ties them and has
    no lm_head); with `fused_qkv=False` each Wqkv is split into its Wq, Wk and Wv rows."""
    sd = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    if not fused_qkv:
        for key in [k for k in sd if k.endswith("attn.Wqkv.weight")]:
            q, k, v = sd.pop(key).split(cfg.d_model, dim=0)
            prefix = key[: -len("Wqkv.weight")]
            sd.update({prefix + "Wq.weight": q, prefix + "Wk.weight": k, prefix + "Wv.weight": v})
    return sd


# --- driving it as generate does --------------------------------------------------------------------------

def crop_as_assisted_decoding(model, past, n: int):
    """What the installed transformers' `_assisted_decoding` does to a legacy tuple cache after
    rejected candidates: `_crop_past_key_values(model, past_key_values, n)`."""
    try:
        from transformers.generation.candidate_generator import _crop_past_key_values
    except ImportError:  # before 4.35 it lived beside _assisted_decoding
        from transformers.generation.utils import _crop_past_key_values

    return _crop_past_key_values(model, past, n)


class FoundrySession(Session):
    """One generation of llm-foundry's MPT, every call as generate makes it (module doc)."""

    def __init__(self, runner: "FoundryRunner", path, max_len):
        super().__init__(path, max_len, runner.max_seq_len, runner.vocab_size)
        self.runner = runner
        self.past = None

    def _call(self, tokens, mask):
        model = self.runner.model
        # the model's own prepare_inputs_for_generation: with a cache it feeds input_ids[:, -1:] only,
        # whatever generate passes before it, so the fed tokens stand for the whole sequence here
        inputs = model.prepare_inputs_for_generation(tokens, past_key_values=self.past, attention_mask=mask,
                                                     use_cache=True)
        out = model(**inputs, return_dict=True)
        self.past = out.past_key_values
        self.runner.sync()
        return out.logits

    def _prefill(self, input_ids, attention_mask):
        self.mask = attention_mask
        return self._call(input_ids, attention_mask)

    def _extend(self, tokens):
        """decode (k = 1) as `_sample`'s step; k > 1 as `_assisted_decoding`'s verification call: the
        candidates with the mask k longer, `outputs.logits[:, -k:]`."""
        k = tokens.shape[1]
        mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, k)], dim=1)
        logits = self._call(tokens, mask)
        self.mask = mask
        return logits[:, -k:]

    def _crop(self, n):
        self.past = crop_as_assisted_decoding(self.runner.model, self.past, n)
        self.mask = self.mask[:, :n].clone()
        self.runner.sync()

    def _reorder(self, index):
        from mpt_kv.targets.hf_generation import reorder_as_beam_search

        self.mask = self.mask.index_select(0, index)
        self.past = reorder_as_beam_search(self.runner.model, self.past, index)
        self.runner.sync()

    def kv(self):
        """(B, H, T, hd) views of the stored tensors: torch's key is (b, h, d, s), flash's both (b, s, h, d)."""
        if self.runner.attn_impl == "flash":
            return [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in self.past]
        return [(k.transpose(2, 3), v) for k, v in self.past]


class FoundryRunner(ModelRunner):
    """llm-foundry's MPTForCausalLM (with GenerationMixin, as from_pretrained gives it) on one device and dtype."""

    name = "llm-foundry"

    def __init__(self, model, device=None, *, attn_impl: str = "torch", name=None, capabilities=None, cfg=None):
        self.attn_impl = attn_impl
        detected = {"static": NO_STATIC, "bucket": NO_BUCKET}
        super().__init__(model, device, name=name, capabilities=capabilities, cfg=cfg, detected=detected)

    def session(self, path, max_len, bucket=None):
        self.require(path, "bucket" if bucket else None)
        return FoundrySession(self, path, max_len)

    def wqkv_modules(self):
        """Each layer's fused projection. With fused_qkv off there is none (Wq, Wk, Wv each own their
        output, and a key that is all of Wk's output pins nothing): nothing to hook, and P3's other rule
        (no view of a per-step temporary beyond the cache) still judges every cached tensor."""
        return [b.attn.Wqkv for b in self.model.transformer.blocks if hasattr(b.attn, "Wqkv")]


def factory(attn_impl: str = "torch", **fields):
    """A target factory of llm-foundry's MPT with llm-foundry-only `fields` (ONLY_FOUNDRY: each a value
    the oracle follows, else an InputError naming it)."""

    def build(cfg, state_dict, device, dtype):
        modeling, configuration = load()
        config = mpt_config(configuration, cfg, attn_impl, **fields)
        model = generation_class(modeling.MPTForCausalLM)(config)
        model.load_state_dict(foundry_state_dict(state_dict, cfg, fields.get("fused_qkv", True)), strict=True)
        model.to(device=device, dtype=dtype).eval()
        runner = FoundryRunner(model, device, attn_impl=attn_impl, cfg=cfg)
        runner.version = release()
        return runner

    build.__qualname__ = build.__name__ = "build" if not fields and attn_impl == "torch" else \
        "build_" + "_".join(f"{k}_{v}" for k, v in fields.items())
    return build


build = factory()


def flash_unavailable() -> str | None:
    """Why attn_impl="flash" cannot run here: flash_attn does not import (CUDA only); None where it does."""
    try:
        importlib.import_module("flash_attn")
    except Exception as e:
        return f"flash_attn does not import here ({type(e).__name__}: {e}); llm-foundry's attn_impl='flash' needs it"
    return None


class _NoModelRunner(ModelRunner):
    """A target that cannot run anywhere here: every device declared unsupported, with the reason; it has
    no model, and any call is an error (its cases never get that far)."""

    def __init__(self, name, reason, cfg):
        self.model = torch.nn.Module()
        self.name = name
        self.max_seq_len, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        self.sync = lambda: None
        self.capabilities = Capabilities({"cpu": reason, "cuda": reason, "hpu": reason})

    def logits(self, input_ids, attention_mask):
        raise TargetBroken(f"{self.name}: nothing to run ({self.capabilities.unsupported['cpu']})")

    def session(self, path, max_len, bucket=None):
        raise TargetBroken(f"{self.name}: nothing to run ({self.capabilities.unsupported['cpu']})")


def build_flash(cfg, state_dict, device, dtype):
    """llm-foundry's MPT on attn_impl="flash" (cache (b, s, h, d)): where flash_attn does not import, every
    device is declared unsupported with that reason, and no model is built (nothing stands in for it)."""
    load()
    why = flash_unavailable()
    if why is not None:
        return _NoModelRunner("mpt_kv.targets.foundry:build_flash", why, cfg)
    return factory("flash")(cfg, state_dict, device, dtype)
