"""The findings: what mpt-kv knows fails upstream, one room for MPT targets and families alike.

    entries.py                 what a known failure is: the one entry format, its files, the rule that
                               applies an entry to a case (the pytest plugin asks it for every case)
    patterns.py                an entry's pattern names its failure, not any failure
    raw.py                     the files' entries as written (every key kept), for the tables and repros
    known_failures.json        the MPT targets' entries (a project's own file replaces it)
    family_known_failures.json the family checks' entries
    grouping.py                a finding: the entries of one upstream bug, grouped and worded once
    user_path.py               how a user reaches it (a default generate call, an option, or neither)
    costs.py                   what it pins at a real config (mpt_kv/data/families/)
    repros.py                  its standalone repro (`python -m mpt_kv findings --repro DIR`), written
                               from sources/ by scripts.py, transformers_repros.py, port_repros.py
    sweep.py                   the repros run in published releases (`python -m mpt_kv sweep --repros`)

Adding a finding is an entry at the end of its file; a finding no template covers gets its script in
sources/kept/ (an MPT target's, named by the entry's `repro`) or a template rule here.
No torch is imported by this package's own `__init__`, `entries`, `raw` and `patterns` (the plugin reads
them before a worker's card is pinned).
"""
