"""Model shape and the weights every target shares.

The reference and every target are built from one `ModelConfig` and load one state_dict in
transformers' `MptForCausalLM` format, so any disagreement is the cache code, not the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Integral, Real

import torch

from mpt_kv.errors import InputError
from mpt_kv import devices

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# ALiBi's key positions are float32 (as in MPT): integers are exact in float32 only up to 2**24,
# so beyond it two positions would get the same bias (and a 2**31 buffer would be 8 bytes x heads x 2**31)
MAX_SEQ_LEN = 2 ** 24
SIZES = ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len")
GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 32          # ALiBi is built this far: total length (prompt + new) is capped here
    clip_qkv: float | None = None  # clamp mixed_qkv to [-clip_qkv, clip_qkv] before the split
    alibi_bias_max: int = 8
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        """Every field checked here, once: the reference, the targets and the caches trust them."""
        for name in SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise InputError(f"ModelConfig.{name}={value!r} ({type(value).__name__}): must be an int >= 1")
            if value < 1:
                raise InputError(f"ModelConfig.{name}={value} must be >= 1")
            object.__setattr__(self, name, int(value))
        if self.max_seq_len > MAX_SEQ_LEN:
            raise InputError(f"ModelConfig.max_seq_len={self.max_seq_len} exceeds {MAX_SEQ_LEN} (2**24): ALiBi's "
                             "float32 key positions are exact only that far")
        if self.d_model % self.n_heads:
            raise InputError(f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.clip_qkv is not None:
            object.__setattr__(self, "clip_qkv", positive_number("clip_qkv", self.clip_qkv, "or None (no clipping)"))
        object.__setattr__(self, "alibi_bias_max", positive_number("alibi_bias_max", self.alibi_bias_max))
        object.__setattr__(self, "layer_norm_epsilon", positive_number("layer_norm_epsilon", self.layer_norm_epsilon))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_hf(self):
        """The equivalent transformers `MptConfig` (use_cache on: its default is False)."""
        from transformers import MptConfig

        return MptConfig(
            d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
            vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, expansion_ratio=4,
            layer_norm_epsilon=self.layer_norm_epsilon, use_cache=True,
            attn_config={"clip_qkv": self.clip_qkv, "alibi_bias_max": self.alibi_bias_max,
                         "alibi": True, "softmax_scale": None},
        )

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    @property
    def n_params(self) -> int:
        """Parameters of the reference (lm_head tied to wte, counted once)."""
        D = self.d_model
        return self.vocab_size * D + self.n_layers * (12 * D * D + 2 * D) + D


def positive_number(name: str, value, alternative: str = "") -> int | float:
    """A finite real > 0 (NaN compares false to everything, so `value <= 0` alone lets it through)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise InputError(f"ModelConfig.{name}={value!r}: must be a finite number > 0" + (f" {alternative}" if alternative else ""))
    return value


def as_dtype(dtype) -> torch.dtype:
    """"fp32"/"bf16" or torch.float32/torch.bfloat16: the dtypes the tolerances are calibrated for
    (docs/calibration.md). Any other (float16, float64) is refused: a check must not pass in a
    dtype nobody calibrated, and no Capabilities feature could declare it unsupported."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise InputError(f"dtype {dtype!r}: the suite supports {', '.join(DTYPES)} only "
                     f"({', '.join(map(str, DTYPES.values()))}; its tolerances are calibrated for those)")


def check_fits_in_memory(cfg: ModelConfig, what: str, kind: str = "cpu") -> None:
    """Refuse, before anything is allocated, a config whose float32 weights (and ALiBi buffer) do
    not fit in the memory free on `kind`: the allocator failing half way is a worse message. The
    free memory is read only for configs above 256 MiB (reading it for every tiny case is waste)."""
    weights = 4 * cfg.n_params
    alibi = (4 * cfg.n_heads + 12) * cfg.max_seq_len  # the (H, 1, L) float32 bias and its int64/float32 positions
    check_bytes_free(weights + alibi, kind, f"{what}: ModelConfig({cfg.describe()})",
                     f"float32 weights {cfg.n_params:,} x 4 bytes = {weights / GiB:.1f} GiB + ALiBi {alibi / GiB:.1f} GiB")


def check_bytes_free(need: int, kind: str, what: str, detail: str) -> None:
    """Refuse, before it is allocated, `need` bytes on device `kind` that are not free there (the
    allocator failing half way, or the OOM killer, is a worse message). The free memory is read
    only above 256 MiB (reading it for every tiny case is waste)."""
    if need < 256 << 20:
        return
    free, source = devices.available_memory(kind)
    if need > free:
        raise InputError(f"{what} needs about {need / GiB:.1f} GiB of {kind} memory ({detail}), but only "
                         f"{free / GiB:.1f} GiB is free ({source})")


def state_dict_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every `MptForCausalLM` key of `cfg` and its shape (lm_head.weight: tied to wte, optional)."""
    D, V = cfg.d_model, cfg.vocab_size
    shapes = {"transformer.wte.weight": (V, D)}
    for i in range(cfg.n_layers):
        p = f"transformer.blocks.{i}."
        shapes.update({p + "norm_1.weight": (D,), p + "attn.Wqkv.weight": (3 * D, D), p + "attn.out_proj.weight": (D, D),
                       p + "norm_2.weight": (D,), p + "ffn.up_proj.weight": (4 * D, D),
                       p + "ffn.down_proj.weight": (D, 4 * D)})
    shapes["transformer.norm_f.weight"] = (D,)
    shapes["lm_head.weight"] = (V, D)
    return shapes


def check_state_dict(cfg: ModelConfig, sd) -> None:
    """`sd` holds exactly `cfg`'s MptForCausalLM keys (lm_head.weight optional: tied), each a
    floating tensor of its shape with data (not on meta): an error naming the key and the config,
    where torch's load_state_dict lists every key of a module it cannot match, or a target loads
    what it happens to find."""
    from collections.abc import Mapping

    where = f"for ModelConfig({cfg.describe()})"
    if not isinstance(sd, Mapping):
        raise InputError(f"state_dict is {type(sd).__name__}: expected a dict of MptForCausalLM weights {where}")
    shapes = state_dict_shapes(cfg)
    missing = [k for k in shapes if k not in sd and k != "lm_head.weight"]
    extra = [k for k in sd if k not in shapes]
    if missing or extra:
        raise InputError(f"state_dict keys: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                         f"{extra[:4]}{' ...' if len(extra) > 4 else ''} (of {len(shapes)} keys {where})")
    for key, value in sd.items():
        if not torch.is_tensor(value) or not value.dtype.is_floating_point or value.is_meta:
            what = type(value).__name__ if not torch.is_tensor(value) else f"a {value.dtype} tensor on {value.device}"
            raise InputError(f"state_dict[{key!r}] is {what}: expected a floating tensor with data {where}")
        if tuple(value.shape) != shapes[key]:
            raise InputError(f"{key} shape {tuple(value.shape)}: expected {shapes[key]} {where}")


def random_state_dict(cfg: ModelConfig, seed: int = 0, std: float = 0.3, device=None) -> dict[str, torch.Tensor]:
    """Seeded random weights in `MptForCausalLM` key format (fp32, CPU; `device`: drawn there, by its
    own generator where it has one: other numbers than the CPU's, the same for every target of a run,
    and an MPT-7B's 6.7 billion in a second on a GPU instead of about a minute on one CPU core).

    std 0.3 rather than the usual 0.02: with tiny weights every logit is near zero and a
    broken cache can hide inside the tolerance (measured on a tiny fp32 model, full forward vs prefill +
    4 cached steps: max abs diff ~2e-7 at std 0.02, ~6e-6 at std 0.3). Above d_model
    32 the projections' std shrinks as 1/sqrt(d_model) (fan-in), so every width keeps the gain of
    d_model 32: with 0.3 at d_model 256 and 4 layers the activations saturate and the model turns
    chaotic, its cached and uncached fp32 paths 3e-4 of the logit scale apart and bf16 63% from
    fp32, where fan-in scaling measured 1e-6 and 2% (docs/calibration.md)."""
    kind = torch.device(device).type if device is not None else "cpu"
    check_fits_in_memory(cfg, "random_state_dict", kind)
    try:
        g = torch.Generator(device=device or "cpu").manual_seed(seed)
    except RuntimeError:  # a device without a generator of its own (or a simulated one): the CPU's
        g = torch.Generator().manual_seed(seed)
    D, V = cfg.d_model, cfg.vocab_size
    std = std * min(1.0, (32 / D) ** 0.5)

    def w(*shape, scale=std):
        return (torch.randn(*shape, generator=g, device=g.device) * scale).to(device or "cpu")

    sd = {"transformer.wte.weight": w(V, D, scale=1.0)}
    for i in range(cfg.n_layers):
        p = f"transformer.blocks.{i}."
        sd[p + "norm_1.weight"] = 1 + w(D, scale=0.1)
        sd[p + "attn.Wqkv.weight"] = w(3 * D, D)
        sd[p + "attn.out_proj.weight"] = w(D, D)
        sd[p + "norm_2.weight"] = 1 + w(D, scale=0.1)
        sd[p + "ffn.up_proj.weight"] = w(4 * D, D)
        sd[p + "ffn.down_proj.weight"] = w(D, 4 * D, scale=std / 2)
    sd["transformer.norm_f.weight"] = 1 + w(D, scale=0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied, as in MPT
    return sd
