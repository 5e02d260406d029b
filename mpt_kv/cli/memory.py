"""`python -m mpt_kv memory`: the analytic memory model for a preset and config, and the seed
PR's table next to the model (`mpt_kv.memory.analytic`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from mpt_kv.memory.analytic import (
    DTYPES, GiB, MiB, PRESETS, Estimate, estimate, n_params, seed_table_text,
)


DEFAULT_TOKENS = 128  # input and new tokens each, as in the seed PR's first row


def default_tokens(max_seq_len: int, max_input: int | None, max_new: int | None) -> tuple[int, int, str]:
    """(input, new, note): fill in what the user left out so that the defaults fit the preset.

    128 each where there is room; on a shorter preset the prompt takes half of max_seq_len (or
    what a given --max-new-tokens leaves) and new tokens take the rest (tiny, 64: 32 + 32).
    `note` says which defaults were cut, "" if none. Input the user gave is kept as is: the
    caller's checks reject it with the value and the limit.
    """
    cut = []
    if max_input is None:
        room = max_seq_len - (max_new if max_new is not None else max_seq_len // 2)
        max_input = min(DEFAULT_TOKENS, room)
        if max_input < DEFAULT_TOKENS:
            cut.append(f"--max-input-tokens {max_input}")
    if max_new is None:
        max_new = max(0, min(DEFAULT_TOKENS, max_seq_len - max_input))
        if max_new < DEFAULT_TOKENS:
            cut.append(f"--max-new-tokens {max_new}")
    note = ""
    if cut:
        note = (f"note: max_seq_len is {max_seq_len}, so the defaults are {' and '.join(cut)} "
                f"(not {DEFAULT_TOKENS}); pass them to choose")
    return max_input, max_new, note


def main(argv: list[str] | None = None) -> int:
    """`python -m mpt_kv memory` (argv may start with "memory" or not)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["memory"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m mpt_kv memory", description=" ".join(__doc__.split()))
    p.add_argument("--model", default="mpt-7b", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help=f"default {DEFAULT_TOKENS}, or half of a smaller preset's max_seq_len")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default {DEFAULT_TOKENS}, or what is left of a smaller preset's max_seq_len")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--max-seq-len", type=int, default=None, help="override the preset's max_seq_len")
    p.add_argument("--softmax-dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--no-trim-logits", action="store_true", help="logits for every prefill position")
    p.add_argument("--fused-softmax", action="store_true", help="one score-sized tensor per layer")
    p.add_argument("--held-caches", type=int, default=0, help="caches of earlier calls still referenced")
    p.add_argument("--seed-table", action="store_true", help="also compare with the seed PR's table")
    a = p.parse_args(argv)

    shape = PRESETS[a.model]
    if a.max_seq_len is not None:
        if a.max_seq_len <= 0:
            p.error(f"--max-seq-len must be >= 1, got {a.max_seq_len}")
        shape = replace(shape, max_seq_len=a.max_seq_len)
    if a.batch_size <= 0:
        p.error(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.max_input_tokens is not None and a.max_input_tokens <= 0:
        p.error(f"--max-input-tokens must be >= 1, got {a.max_input_tokens}")
    if a.max_new_tokens is not None and a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1 (a generation makes at least one token), got {a.max_new_tokens}")
    limit = f"{a.model}'s max_seq_len {shape.max_seq_len} (ALiBi is built only that far); pass --max-seq-len to override"
    if a.max_input_tokens is not None and a.max_input_tokens > shape.max_seq_len:
        p.error(f"--max-input-tokens {a.max_input_tokens} exceeds {limit}")
    if a.max_input_tokens is None and a.max_new_tokens is not None and a.max_new_tokens >= shape.max_seq_len:
        p.error(f"--max-new-tokens {a.max_new_tokens} leaves no room for a prompt in {limit}")
    a.max_input_tokens, a.max_new_tokens, note = default_tokens(shape.max_seq_len, a.max_input_tokens,
                                                                a.max_new_tokens)
    if a.max_new_tokens < 1:  # the prompt given fills max_seq_len
        p.error(f"--max-input-tokens {a.max_input_tokens} leaves no room for a new token in {limit}")
    if a.held_caches < 0:
        p.error(f"--held-caches must be >= 0, got {a.held_caches}")
    total = a.max_input_tokens + a.max_new_tokens
    if total > shape.max_seq_len:
        p.error(f"--max-input-tokens {a.max_input_tokens} + --max-new-tokens {a.max_new_tokens} = {total} "
                f"exceeds {limit}")

    s = DTYPES[a.dtype]
    print(f"{a.model}: {n_params(shape):,} params, {a.dtype}, batch {a.batch_size}, "
          f"input {a.max_input_tokens} + new {a.max_new_tokens} = cache length {total}")
    if note:
        print(note)
    rows = [
        (label, estimate(
            shape, a.batch_size, a.max_input_tokens, a.max_new_tokens, s, fixed,
            trim_logits=not a.no_trim_logits, softmax_itemsize=DTYPES[a.softmax_dtype],
            fused_softmax=a.fused_softmax, held_caches=a.held_caches,
        ))
        for label, fixed in (("fixed (clones)", True), ("views of mixed_qkv", False))
    ]
    unit = GiB if max(est.max_allocated for _, est in rows) >= GiB else MiB  # small presets in MiB
    print(f"{'cache':18} {Estimate.header(unit)}")
    for label, est in rows:
        print(f"{label:18} {est.row(unit)}")
    if a.seed_table:
        print()
        print("seed PR table (mpt-7b, bf16, one Gaudi, optimum-habana's run_generation.py) vs the Gaudi model:")
        print(seed_table_text())
    return 0
