"""Standalone reproduction: optimum-habana's Gaudi MPT ignores the config's alibi_bias_max (ALiBi slopes always for 8).

GaudiMptModel.forward builds its ALiBi table with self.build_mpt_alibi_tensor(self.num_heads,
self.config.max_seq_len, device=...) and never passes attn_config.alibi_bias_max, so the default 8
is used whatever the config says (optimum-habana 1.21.2 optimum/habana/transformers/models/mpt/
modeling_mpt.py:285, as transformers' MptModel.forward, 4.55.4 line 377). The script loads
optimum-habana's MPT module alone on CPU, replays what adapt_transformers_to_gaudi does for MPT,
and builds two GaudiMptForCausalLM with the same weights, one with alibi_bias_max=16 and one with
8: their logits must differ (the slopes 2^(-alibi_bias_max * i / n_heads) differ for every head),
and are equal where the value is ignored.
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in every one.
Needs torch, transformers and optimum-habana (pip install --no-deps optimum-habana), no HPU.
Exit status: 1 the bug is there, 0 it is not, 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
import traceback
import types
from pathlib import Path

try:
    import torch
    import transformers
    from transformers import MptConfig
    import transformers.models.mpt.modeling_mpt as hf
except Exception as e:  # fail closed (ImportError, or transformers' RuntimeError wrapping one): never "fixed"
    print(f"cannot run the experiment: {type(e).__name__}: {e}")
    sys.exit(2)

CALL = ("any forward of optimum-habana's MPT (GaudiMptForCausalLM) whose config sets "
        "attn_config['alibi_bias_max'] to other than 8 - model.generate(...) on Gaudi, any path, cached or not")
FIX = ("pass alibi_bias_max=self.config.attn_config.alibi_bias_max to build_mpt_alibi_tensor in "
       "GaudiMptModel.forward")

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


def optimum_habana_root() -> Path:
    spec = importlib.util.find_spec("optimum")
    for folder in spec.submodule_search_locations if spec else []:
        if (Path(folder) / "habana").is_dir():
            return Path(folder) / "habana"
    raise ModuleNotFoundError("optimum-habana is not installed")


def load_port(root: Path):
    """optimum-habana's MPT module alone. Its parent packages' __init__ files need an HPU stack
    (a Synapse version check, habana_frameworks imports): they are registered as plain packages,
    their folders as __path__, so they never run. The module itself runs on CPU."""
    parts = PORT_MODULE.split(".")
    for depth in range(2, len(parts)):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[2:depth]))]
            sys.modules[name] = package
    return importlib.import_module(PORT_MODULE)


def adapt_mpt(root: Path, port) -> list[str]:
    """What this release's adapt_transformers_to_gaudi does for MPT, replayed: its own lines that
    write into transformers' MPT module, read from optimum/habana/transformers/modeling_utils.py
    (parsed, not imported: importing it needs an HPU stack). 1.14 and later replace classes
    (MptModel = GaudiMptModel, ...); 1.7.3 to 1.13 set functions on transformers' classes
    (MptAttention.forward = gaudi_mpt_attention_forward, ...). Returns the lines replayed."""
    path = root / "transformers" / "modeling_utils.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    adapt = next((node for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "adapt_transformers_to_gaudi"), None)
    if adapt is None:
        raise LookupError(f"{path} defines no adapt_transformers_to_gaudi")
    prefix = "transformers.models.mpt.modeling_mpt."
    replayed = []
    for node in sorted((n for n in ast.walk(adapt) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        for target in node.targets:
            dotted = ast.unparse(target)
            if not dotted.startswith(prefix):
                continue
            name, *attribute = dotted[len(prefix):].split(".")
            value = getattr(port, ast.unparse(node.value).rsplit(".", 1)[-1])
            if attribute:
                setattr(getattr(hf, name), attribute[0], value)
            else:
                setattr(hf, name, value)
            replayed.append(f"modeling_utils.py:{node.lineno}: {dotted} = {ast.unparse(node.value)}")
    if not replayed:
        raise LookupError(f"adapt_transformers_to_gaudi in {path} patches nothing of transformers' MPT")
    return replayed


def gaudi_mpt(port, input_ids, attention_mask, **attn_config):
    """optimum-habana's GaudiMptForCausalLM of CONFIG (seeded weights), in float32, or in bfloat16
    where this release's attention cannot run float32 on CPU (1.14.0 to 1.16.0 multiply the
    values by softmax(attention_scores.bfloat16()): "expected scalar type BFloat16 but found
    Float"; on Gaudi the model runs in bf16 anyway)."""
    torch.manual_seed(0)
    config = MptConfig(**CONFIG, attn_config={"alibi": True, **attn_config})
    model = port.GaudiMptForCausalLM(config).eval()
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask, use_cache=False)
    except RuntimeError as e:
        if "BFloat16" not in str(e):
            raise
        model.to(torch.bfloat16)
    return model


def prompts():
    """A batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them."""
    torch.manual_seed(0)
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    return input_ids, attention_mask


def setup():
    """(optimum-habana's MPT module, its root), after replaying its adapt_transformers_to_gaudi
    lines for MPT, with the versions printed."""
    root = optimum_habana_root()
    port = load_port(root)
    try:
        release = importlib.metadata.version("optimum-habana")
    except importlib.metadata.PackageNotFoundError:
        release = "(no distribution metadata)"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, optimum-habana {release} from {root}")
    for line in adapt_mpt(root, port):
        print(f"  replayed {line}")
    return port, root


def main() -> int:
    port, _ = setup()
    input_ids, attention_mask = prompts()
    wide = gaudi_mpt(port, input_ids, attention_mask, alibi_bias_max=16)
    default = gaudi_mpt(port, input_ids, attention_mask, alibi_bias_max=8)
    default.load_state_dict(wide.state_dict())  # the same weights: only the config's value differs
    default.to(wide.dtype)
    assert wide.config.attn_config.alibi_bias_max == 16 and default.config.attn_config.alibi_bias_max == 8
    print(f"two {type(wide).__name__} ({wide.dtype}), the same weights, alibi_bias_max 16 and 8")
    with torch.no_grad():
        logits = [m(input_ids, attention_mask=attention_mask, use_cache=False).logits.float() for m in (wide, default)]
    real = attention_mask.bool()
    difference = (logits[0] - logits[1])[real].abs().max().item()
    print(f"max |logits(alibi_bias_max=16) - logits(alibi_bias_max=8)| at the real tokens: {difference:.3e}")
    if difference == 0.0:
        print("BUG: alibi_bias_max=16 gives the logits of alibi_bias_max=8: the config's value is ignored")
        return 1
    print("OK: alibi_bias_max changes the ALiBi slopes")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
