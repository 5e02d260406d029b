"""Fake `habana_frameworks.torch` (tests/fakes/README.md): registers `torch.hpu` and, in its
default mode, runs every hpu op on cpu. Loaded by `import torch` through the `torch.backends`
entry point, as the real one is since Gaudi software 1.18 / PyTorch 2.5."""

import json
import os


def _autoload():
    """The entry point torch calls at the end of `import torch`. Defined before `import torch`
    below: a process that imports this package first gets here again from inside torch."""


import torch  # noqa: E402
from torch.overrides import TorchFunctionMode

from habana_frameworks.torch import hpu  # noqa: E402

MODE = os.environ.get("MPT_KV_FAKE_HPU", "cpu")


def _is_hpu(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "hpu") or (isinstance(x, str) and x.split(":")[0] == "hpu")


class HpuOnCpu(TorchFunctionMode):
    """Every `hpu` device argument becomes `cpu`; in broken mode, every op given it raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.device and any(_is_hpu(a) for a in (*args, *kwargs.values())):
            if MODE == "broken":
                raise RuntimeError(f"synStatus 26 [Device not found]: fake broken HPU, {func.__name__} failed")
            args = tuple(torch.device("cpu") if _is_hpu(a) else a for a in args)
            kwargs = {k: torch.device("cpu") if _is_hpu(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


if not hasattr(torch, "hpu"):
    torch._register_device_module("hpu", hpu)
    HpuOnCpu().__enter__()  # stays on the mode stack of this (the main) thread
    if os.environ.get("MPT_KV_FAKE_HPU_LOG"):
        with open(os.environ["MPT_KV_FAKE_HPU_LOG"], "a") as f:
            f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"),
                                "visible": os.environ.get("HABANA_VISIBLE_MODULES"), "pid": os.getpid()}) + "\n")
