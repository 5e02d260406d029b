"""A fork of optimum-habana 1.21.2's GPT-NeoX port with the seed bug class put back.

The port's ``GaudiGPTNeoXAttention.forward`` (optimum/habana/transformers/models/gpt_neox/
modeling_gpt_neox.py:138) ends the q/k/v split with ``value = value.contiguous()``; this fork drops
it, so at the prefill the cached V is a view (a permuted slice) of ``query_key_value``'s output,
which pins the whole fused output (q, k and v of every token) until the first decode step's
``torch.cat`` copies. K stays an owning tensor: rotary embeddings and the ``torch.cat`` with its
pass-through part make a new one (as transformers 4.55's own GPT-NeoX: V only).

Written from docs/families.md alone: star re-export of the port, the overridden attention, and the
port's layer overridden too because it builds ``GaudiGPTNeoXAttention`` through the port module's
own globals (modeling_gpt_neox.py:198). ``GaudiGPTNeoXLayer`` itself is built through
transformers' name, which ``adapt_transformers_to_gaudi`` swaps, so the model picks this one up.
"""

import torch
from optimum.habana.transformers.models.gpt_neox.modeling_gpt_neox import *  # noqa: F403
from optimum.habana.transformers.models.gpt_neox import modeling_gpt_neox as port


class GaudiGPTNeoXAttention(port.GaudiGPTNeoXAttention):
    def forward(self, hidden_states, attention_mask, position_ids, head_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, padding_mask=None, cache_position=None, position_embeddings=None,
                token_idx=None):
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(*qkv.size()[:-1], self.num_attention_heads, 3 * self.head_size)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)  # the bug: no .contiguous(), a view
        query_rot, query_pass = query[..., : self.rotary_ndims], query[..., self.rotary_ndims :]
        key_rot, key_pass = key[..., : self.rotary_ndims], key[..., self.rotary_ndims :]
        seq_len = key.shape[-2] + (layer_past[0].shape[-2] if layer_past is not None else 0)
        cos, sin = self.rotary_emb(value, seq_len=seq_len)
        query, key = port.apply_customized_rope(query_rot, key_rot, cos, sin, position_ids, training=self.training)
        query = torch.cat((query, query_pass), dim=-1).contiguous()
        key = torch.cat((key, key_pass), dim=-1).contiguous()
        if layer_past is not None:
            past_key, past_value = layer_past[0], layer_past[1]
            if token_idx is not None:
                past_key.index_copy_(2, token_idx - 1, key)
                past_value.index_copy_(2, token_idx - 1, value)
                key, value = past_key, past_value
            else:
                key, value = torch.cat((past_key, key), dim=-2), torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        out, weights = port.gaudi_eager_attention_forward(
            query, key, value, attention_mask=attention_mask, head_mask=head_mask, norm_factor=self.scaling,
            attention_dropout=self.config.attention_dropout, training=self.training)
        out = self.dense(self._merge_heads(out, self.num_attention_heads, self.head_size))
        return (out, present, weights) if output_attentions else (out, present)


class GaudiGPTNeoXLayer(port.GaudiGPTNeoXLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.attention = GaudiGPTNeoXAttention(config, layer_idx)
