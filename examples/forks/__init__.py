"""Forks of optimum-habana's ports, written as docs/families.md's "Writing a fork of a port" says."""
