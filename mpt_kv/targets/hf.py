"""transformers' `MptForCausalLM` with its own cache classes.

concat = `DynamicCache` (every version); static = `StaticCache` where the installed version
supports it for MPT (5.x; 4.55's MPT forward has no static path). The installed version's
keyword for the cache is `cache` in 5.x and `past_key_values` before.
"""

from __future__ import annotations

import inspect

import torch

from mpt_kv.errors import TargetUnavailable
from mpt_kv.model.session import Session, check_prompt
from mpt_kv.targets import Capabilities, Runner


def transformers_version() -> str:
    import transformers

    return transformers.__version__


class HFSession(Session):
    def __init__(self, runner: "HFRunner", path: str, max_len: int):
        from transformers import DynamicCache, StaticCache

        cfg = runner.model.config
        super().__init__(path, max_len, cfg.max_seq_len, cfg.vocab_size)
        self.runner = runner
        if path == "concat":
            self.cache = DynamicCache(config=cfg) if runner.major >= 5 else DynamicCache()
        else:
            self.cache = StaticCache(config=cfg, max_cache_len=max_len)

    def _forward(self, input_ids, mask):
        kw = {self.runner.cache_kw: self.cache}
        out = self.runner.model(input_ids, attention_mask=mask, use_cache=True, **kw)
        returned = getattr(out, self.runner.cache_kw, None) if hasattr(out, self.runner.cache_kw) else None
        if returned is None:
            returned = out.past_key_values
        self.cache = returned  # 4.55 may hand back a legacy tuple
        self.runner.sync()
        return out.logits

    def _prefill(self, input_ids, attention_mask):
        self.mask = attention_mask.to(torch.long)
        return self._forward(input_ids, self.mask)

    def _decode(self, tokens):
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self._forward(tokens, self.mask)[:, -1]

    def kv(self):
        c = self.cache
        if isinstance(c, (tuple, list)):
            return [(k, v) for k, v in c]
        if hasattr(c, "layers"):
            return [(layer.keys, layer.values) for layer in c.layers]
        return list(zip(c.key_cache, c.value_cache))


class HFRunner(Runner):
    name = "transformers"

    def __init__(self, cfg, state_dict, device, dtype, sync):
        try:
            from transformers import MptForCausalLM
        except ImportError as e:
            raise TargetUnavailable(f"transformers is not installed ({e})") from e
        self.version = transformers_version()
        self.major = int(self.version.split(".")[0])
        self.model = MptForCausalLM(cfg.to_hf())
        self.model.load_state_dict(state_dict, strict=True)
        self.model.to(device=device, dtype=dtype).eval()
        self.sync = sync
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        unsupported = {"bucket": "transformers' StaticCache has no cache_idx buckets"}
        if self.major < 5:
            unsupported["static"] = (
                f"transformers {self.version}: MptForCausalLM has no static-cache path "
                "(generate(cache_implementation='static') raises for MPT before 5.0)")
        self.capabilities = Capabilities(unsupported)

    def logits(self, input_ids, attention_mask):
        cfg = self.model.config
        check_prompt(input_ids, attention_mask, cfg.vocab_size, cfg.max_seq_len)  # before MPT crashes inside
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits
        self.sync()
        return out

    def session(self, path, max_len, bucket=None):
        self.require(path)
        return HFSession(self, path, max_len)


def build(cfg, state_dict, device, dtype):
    from mpt_kv.devices import sync

    return HFRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))
