"""transformers' `MptForCausalLM` with its own cache classes.

concat = `DynamicCache` (every version); static = `StaticCache` where the installed version
supports it for MPT (5.x; 4.55's MPT forward has no static path). The installed version's
keyword for the cache is `cache` in 5.x and `past_key_values` before. The driving is
`mpt_kv.targets.wrappers.TransformersRunner`, which any transformers-style model can use.
"""

from __future__ import annotations

from mpt_kv.errors import TargetUnavailable
from mpt_kv.versions import transformers_version
from mpt_kv.targets import Capabilities
from mpt_kv.targets.gaudi import reads_attribute
from mpt_kv.targets.wrappers import TransformersRunner, TransformersSession

HFSession = TransformersSession  # the names this module had before the wrappers




def static_path_missing(version: str) -> str | None:
    """Why transformers `version`'s MPT has no static-cache path; None where it has one. Also the
    rule by which tests/test_repros.py reads a static-path repro's "cannot run" (exit 2) there."""
    if int(version.split(".")[0]) < 5:
        return (f"transformers {version}: MptForCausalLM has no static-cache path "
                "(generate(cache_implementation='static') raises for MPT before 5.0)")
    return None


class HFRunner(TransformersRunner):
    name = "transformers"

    def __init__(self, cfg, state_dict, device, dtype, sync=None):
        try:
            from transformers import MptForCausalLM
        except ImportError as e:
            raise TargetUnavailable(f"transformers is not installed ({e})") from e
        self.version = transformers_version()
        self.major = int(self.version.split(".")[0])
        model = MptForCausalLM(cfg.to_hf())
        model.load_state_dict(state_dict, strict=True)
        model.to(device=device, dtype=dtype).eval()
        unsupported = {}
        why = static_path_missing(self.version)
        if why:
            unsupported["static"] = why
        from transformers.models.mpt.modeling_mpt import MptAttention

        if not reads_attribute(MptAttention.forward, "clip_qkv"):  # older releases (4.40) ignore it
            unsupported["clip_qkv"] = f"transformers {self.version}: MptAttention.forward never reads clip_qkv"
        super().__init__(model, device, capabilities=Capabilities(unsupported), sync=sync)


def build(cfg, state_dict, device, dtype):
    return HFRunner(cfg, state_dict, device, dtype)
