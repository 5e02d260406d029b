"""What a run reaches of the upstream cache code: coverage.py's lines and branches of each
implementation's attention and cache functions (docs/reach.md, "The upstream code a run reaches").

    selection.py  which upstream files and functions count, why a function was never entered, the floors
                  (the data, written once)
    measure.py    a run under coverage.py (`python -m mpt_kv run --coverage OUT`, xdist workers included)
                  and its summary: per function, lines and branches executed, the reason where never entered
    tables.py     the summaries of several runs (environments) as tables, and the floors they must hold

`python -m mpt_kv coverage SUMMARY.json ...` prints the tables (mpt_kv/cli/coverage.py).
"""
