"""The devices a case can run on: `cpu` always, `cuda` when torch sees a GPU, `hpu` when
`habana_frameworks.torch` imports (Gaudi images ship it; it is on no public registry).

HPU runs in lazy mode by default: ops are queued into a graph that executes at
`htcore.mark_step()`, so `sync` marks a step before anything reads results or memory.

Cards under pytest-xdist (docs/gate.md): one card per worker, chosen by the controller and set
in the worker's environment before the worker's pytest starts, so before anything imports
torch. It has to be that early: since PyTorch 2.5 `import torch` itself loads out-of-tree
backends registered under the `torch.backends` entry point group (Intel Gaudi's
habana_frameworks is one, Gaudi software >= 1.18), and a card is chosen from
HABANA_VISIBLE_MODULES (hpu) or CUDA_VISIBLE_DEVICES (cuda) when the device initialises.

This module imports torch only inside functions: the pytest plugin imports it in every process,
xdist workers included, before their cards are pinned.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys

from mpt_kv.errors import DeviceUnavailable, InputError

KINDS = ("cpu", "cuda", "hpu")
# the variable that makes a process see only some cards: HABANA_VISIBLE_MODULES takes Gaudi
# module IDs (`hl-smi -Q module_id`), CUDA_VISIBLE_DEVICES indices or GPU UUIDs
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "hpu": "HABANA_VISIBLE_MODULES"}
# set in an xdist worker by the controller: {"hpu": "3"}, the card of each kind it was given
# (None: no card was left for it)
ENV_CARDS = "MPT_KV_CARDS"


@functools.cache
def _probe(kind: str) -> str | None:
    """None if usable here, else the reason it is not."""
    if kind == "cpu":
        return None
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no GPU or a CPU build of torch)"
        return None
    if kind == "hpu":
        import torch  # first: since PyTorch 2.5 it loads habana_frameworks itself (autoload)

        try:
            import habana_frameworks.torch  # noqa: F401  registers torch.hpu
            import habana_frameworks.torch.core  # noqa: F401
        except ImportError as e:
            return f"habana_frameworks.torch does not import ({e}); it ships in Gaudi images only"
        try:
            available = torch.hpu.is_available()
        except Exception as e:  # a broken driver or a card that is gone: a reason, not a crash
            return f"torch.hpu.is_available() raised {type(e).__name__}: {e}"
        if not available:
            return "habana_frameworks.torch imported but torch.hpu.is_available() is False"
        return None
    raise DeviceUnavailable(f"unknown device kind {kind!r}: expected one of {KINDS}")


def as_device(device):
    """A torch.device of a kind the suite runs on (KINDS), from a str ("cpu", "cuda:0") or a
    torch.device: an int, "xyz", "meta" or any other kind is an InputError naming it and the
    kinds, where torch would fail later with its own message (or, for meta, compute nothing)."""
    import torch

    parsed = None
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, str):
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError):
            pass
    if parsed is None or parsed.type not in KINDS:
        raise InputError(f"device {device!r} ({type(device).__name__}): expected a str or torch.device of kind "
                         f"{', '.join(KINDS)} (e.g. 'cpu', 'cuda:0', 'hpu')")
    return parsed


def unavailable_reason(kind: str) -> str | None:
    return _probe(kind)


def available_kinds() -> list[str]:
    return [k for k in KINDS if _probe(k) is None]


def torch_device(kind: str):
    """The torch device for `kind`. Under xdist a worker sees only its own card (VISIBLE), so
    the first visible device is always the right one."""
    import torch

    reason = _probe(kind)
    if reason:
        raise DeviceUnavailable(f"device {kind} is not available: {reason}")
    if kind == "cuda":
        return torch.device("cuda", 0)
    return torch.device(kind)


def sync(kind: str) -> None:
    """Make queued work finish: before reading results, timings or memory."""
    import torch

    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "hpu":
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()
        torch.hpu.synchronize()


def available_memory(kind: str) -> tuple[int, str]:
    """(bytes free for a new allocation on `kind`, where that number comes from), read without
    allocating: cpu from /proc/meminfo's MemAvailable (capped by a cgroup v2 limit, which is what
    the OOM killer enforces in a container), else os.sysconf; cuda from torch.cuda.mem_get_info;
    hpu from the allocator's memory_stats (Limit - InUse)."""
    if kind == "cpu":
        free, source = None, ""
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
            free, source = info["MemAvailable"], "MemAvailable in /proc/meminfo"
        except (OSError, KeyError, ValueError):
            free, source = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "os.sysconf(SC_AVPHYS_PAGES)"
        try:
            with open("/sys/fs/cgroup/memory.max") as f:
                limit = f.read().strip()
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read())
            if limit != "max" and int(limit) - used < free:
                free, source = int(limit) - used, "the cgroup's memory.max - memory.current"
        except (OSError, ValueError):
            pass
        return free, source
    import torch

    torch_device(kind)  # raises DeviceUnavailable with the reason if it is not here
    if kind == "cuda":
        return torch.cuda.mem_get_info(0)[0], "torch.cuda.mem_get_info"
    stats = torch.hpu.memory_stats()
    return int(stats["Limit"]) - int(stats["InUse"]), "torch.hpu.memory_stats() Limit - InUse"


# --- cards: counted by the xdist controller, one pinned per worker -------------------------------

def _split(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _hpu_modules() -> list[str]:
    """Module IDs of the Gaudi cards this process may use: HABANA_VISIBLE_MODULES if set, else
    what `hl-smi -Q module_id -f csv,noheader` lists, else 0..device_count()-1."""
    if os.environ.get(VISIBLE["hpu"], "").strip():
        return _split(os.environ[VISIBLE["hpu"]])
    if shutil.which("hl-smi"):
        out = subprocess.run(["hl-smi", "-Q", "module_id", "-f", "csv,noheader"], capture_output=True, text=True,
                             timeout=60)
        ids = [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()]
        if out.returncode == 0 and ids:
            return sorted(ids, key=int)
    import torch

    return [str(i) for i in range(torch.hpu.device_count())]


def _cuda_cards() -> list[str]:
    import torch

    n = torch.cuda.device_count()
    visible = os.environ.get(VISIBLE["cuda"])
    return _split(visible)[:n] if visible is not None else [str(i) for i in range(n)]


def _survey_here(kinds) -> dict[str, dict]:
    """{kind: {"reason": why not usable or None, "cards": [...]}}, probed in this process."""
    out = {}
    for kind in kinds:
        try:
            reason = _probe(kind)
            cards = [] if reason else (_hpu_modules() if kind == "hpu" else _cuda_cards())
        except Exception as e:
            reason, cards = f"counting its cards raised {type(e).__name__}: {e}", []
        if not reason and not cards:
            reason = "no card found"
        out[kind] = {"reason": reason, "cards": cards}
    return out


def _cannot_be_here(kind: str) -> str | None:
    """A reason `kind` is absent that needs no device call (None: it might be here)."""
    if kind == "hpu" and importlib.util.find_spec("habana_frameworks") is None:
        return "habana_frameworks is not installed; it ships in Gaudi images only"
    if kind == "cuda":
        torch = sys.modules.get("torch")
        if torch is not None and torch.version.cuda is None and torch.version.hip is None:
            return "this torch is a CPU build (torch.version.cuda is None)"
    return None


def survey(kinds) -> dict[str, dict]:
    """What the xdist controller needs to hand out cards: for each accelerator kind, the reason
    it is unusable (None if usable) and its cards. Probed in a subprocess whenever a device
    might be there, so the controller itself never initialises a device, which could take a
    card its workers need (a Gaudi card is acquired by one process)."""
    kinds = [k for k in kinds if k != "cpu"]
    out = {k: {"reason": r, "cards": []} for k in kinds if (r := _cannot_be_here(k))}
    todo = [k for k in kinds if k not in out]
    if todo:
        try:
            proc = subprocess.run([sys.executable, "-m", "mpt_kv.devices", *todo], capture_output=True, text=True,
                                  timeout=300)
            out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            out.update({k: {"reason": "probing it in a subprocess took over 300 s", "cards": []} for k in todo})
        except (IndexError, ValueError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            out.update({k: {"reason": f"probing it in a subprocess failed (exit {proc.returncode}): {tail}",
                            "cards": []} for k in todo})
    return out


def assigned_cards() -> dict[str, str | None]:
    """In an xdist worker: the card of each kind the controller gave it ({} elsewhere)."""
    return json.loads(os.environ.get(ENV_CARDS, "{}"))


def pin_env(assignment: dict[str, str | None]) -> dict[str, str]:
    """The environment that pins a process to `assignment` ({"hpu": "3"}): each kind's
    visibility variable, and ENV_CARDS so the worker knows what it was given."""
    env = {VISIBLE[k]: card for k, card in assignment.items() if card is not None}
    env[ENV_CARDS] = json.dumps(assignment)
    return env


def check_pinned() -> None:
    """In an xdist worker, as early as possible: the visibility variables hold the assigned
    cards. The controller sets them before the worker starts; if something changed them, put
    them back while that can still matter (torch not imported yet), else refuse loudly."""
    for var, card in pin_env(assigned_cards()).items():
        if var == ENV_CARDS or os.environ.get(var) == card:
            continue
        if "torch" in sys.modules:
            raise DeviceUnavailable(
                f"{os.environ.get('PYTEST_XDIST_WORKER', 'this process')}: {var} is "
                f"{os.environ.get(var)!r}, not its card {card!r}, and torch is already imported (PyTorch >= 2.5 loads "
                "device backends at import): pinning now would be too late, the device may already be initialised")
        os.environ[var] = card


class CardPool:
    """The controller's cards of each kind in play, one of each per worker. A worker that goes
    down gives its cards back, so the worker xdist starts in its place (under a new name, gwN
    with N beyond the card count) takes a card that exists."""

    def __init__(self, cards: dict[str, list[str]]):
        self.free = {kind: list(ids) for kind, ids in cards.items()}
        self.held: dict[str, dict[str, str | None]] = {}
        self.log: list[str] = []  # "gw2: hpu 1 (given back by gw1)"
        self._returned: dict[tuple[str, str], str] = {}

    def take(self, worker: str) -> dict[str, str | None]:
        pick = {kind: (free.pop(0) if free else None) for kind, free in self.free.items()}
        self.held[worker] = pick
        self.log.append(f"{worker}: " + ", ".join(
            f"{k} {'none left' if c is None else c}" + (f" (given back by {self._returned.pop((k, c))})"
                                                        if (k, c) in self._returned else "")
            for k, c in pick.items()))
        return pick

    def give_back(self, worker: str) -> None:
        for kind, card in self.held.pop(worker, {}).items():
            if card is not None:
                self.free[kind].insert(0, card)
                self._returned[(kind, card)] = worker


if __name__ == "__main__":  # survey() runs this in a fresh process: python -m mpt_kv.devices hpu cuda
    print(json.dumps(_survey_here(sys.argv[1:] or [k for k in KINDS if k != "cpu"])))
