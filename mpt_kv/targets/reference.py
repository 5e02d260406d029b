"""The reference model as a target (the oracle checks itself: P1-P3 hold for it too)."""

from __future__ import annotations

from mpt_kv.model.reference import ReferenceMPT
from mpt_kv.model.session import TokenIdxSession
from mpt_kv.targets import Runner
from mpt_kv.devices import sync


class ReferenceSession(TokenIdxSession):
    def __init__(self, model: ReferenceMPT, path, max_len, bucket=None, sync=lambda: None):
        super().__init__(path, max_len, bucket, sync, max_seq_len=model.cfg.max_seq_len,
                         vocab_size=model.cfg.vocab_size)
        self.model = model
        self.cache = None

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.cache is None:
            self.cache = self.model.new_cache(self.path, input_ids.shape[0], self.max_len)
            cache_idx = None  # the prefill attends over its own tokens; the buffer is already max_len
        return self.model(input_ids, mask, self.cache, token_idx, cache_idx)

    def _crop_cache(self, n):
        self.cache.crop(n)      # concat: copies of [0, n); static: `written` moves back (cache.py)

    def _reorder_cache(self, index):
        self.cache.reorder(index)  # one layer at a time; static: in place

    def kv(self):
        return list(self.cache.kv)


class ReferenceRunner(Runner):
    name = "reference"
    model_class = ReferenceMPT

    def __init__(self, cfg, state_dict, device, dtype, sync=lambda: None):
        self.model = self.model_class(cfg).load_hf_state_dict(state_dict).to(device=device, dtype=dtype).eval()
        self.sync = sync

    def logits(self, input_ids, attention_mask):
        out = self.model(input_ids, attention_mask)
        self.sync()
        return out

    def session(self, path, max_len, bucket=None):
        return ReferenceSession(self.model, path, max_len, bucket, self.sync)


def build(cfg, state_dict, device, dtype):
    return ReferenceRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))
