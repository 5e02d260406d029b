"""Fake `habana_frameworks.torch.core`."""


def mark_step():
    pass
