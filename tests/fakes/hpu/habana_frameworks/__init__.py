"""Fake habana_frameworks for mpt-kv tests (tests/fakes/README.md)."""
