"""An upstream file's functions as its source shows them: which the selection's rule picks, which lines
need an HPU, and why a function the run never entered was not entered (the reasons docs/reach.md lists).

Functions are named as coverage.py names its function regions ("Class.method", "outer.inner": the `def`s
and `class`es around it, in its statement fields), so a summary joins the two by name and `def` line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from mpt_kv.upstream import selection as S

STATEMENT_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")  # coverage.py's regions walk the same
NOT_DRIVEN = "not driven"
NEEDS_HPU = "needs an HPU"
OPTION = "an option never set"
REASONS = (NEEDS_HPU, OPTION, NOT_DRIVEN)  # every reason starts with one of these


@dataclass(frozen=True)
class Reason:
    """Why a function was never entered: kind (one of REASONS), what (the kernel, the option), where (the
    upstream line or the function it is inherited through)."""

    kind: str
    what: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.what}" + (f" ({self.where})" if self.where else "")


@dataclass
class Function:
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    classes: tuple[str, ...]  # the classes around it, outermost first
    top: str  # the qualname of the outermost function around it (itself if none): the unit the rule selects
    parents: dict = field(repr=False, default_factory=dict)

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def name(self) -> str:
        return self.node.name


def dotted(node: ast.AST) -> str | None:
    """`torch.ops.hpu.mixture_of_experts` for an attribute chain on a name, the name for a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _matches(name: str, markers) -> str | None:
    return next((m for m in markers if name == m or name.startswith(m + ".")), None)


def names_in(node: ast.AST) -> set[str]:
    """Every name a node reads or binds: names, attribute names, arguments, keywords, and the string keys of
    subscripts and `.get(...)` (`kwargs["reuse_cache"]`)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)
    return out


def required(test: ast.AST, positive: bool = True) -> set[str]:
    """The names a condition needs true (positive) or false to take a branch, through `and`, `not`,
    `X is None` / `X is not None` and `X == False`; an `or` needs none of its operands."""
    if isinstance(test, ast.BoolOp):
        if isinstance(test.op, ast.And) == positive:  # `a and b` true, `a or b` false: each operand
            return set().union(*(required(v, positive) for v in test.values))
        return set()
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return required(test.operand, not positive)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], test.comparators[0]
        falsy = isinstance(right, ast.Constant) and right.value in (None, False, 0)
        if falsy and isinstance(op, (ast.Is, ast.Eq)):
            return required(test.left, not positive)
        if falsy and isinstance(op, (ast.IsNot, ast.NotEq)):
            return required(test.left, positive)
        return required(test.left, positive) if positive else set()
    if isinstance(test, ast.Call):  # kwargs.get("reuse_cache"), getattr(config, "use_flash_attention", False)
        return {n for n in names_in(test) if positive}
    if positive:
        name = dotted(test)
        if name:
            return {name, name.rsplit(".", 1)[-1]}
    return set()


class SourceFile:
    """One upstream file's functions and what its source says about them."""

    def __init__(self, path: Path | str, text: str | None = None):
        self.path = Path(path)
        self.text = self.path.read_text(encoding="utf-8") if text is None else text
        self.tree = ast.parse(self.text, filename=str(self.path))
        self.functions: dict[int, Function] = {}  # by `def` line (two `def`s of one name in if/else differ here)
        self.parents: dict[ast.AST, tuple[ast.AST, str]] = {}  # node -> (parent, the field it is in)
        for parent in ast.walk(self.tree):
            for name, value in ast.iter_fields(parent):
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        self.parents[child] = (parent, name)
        self._walk(self.tree, [], (), None)
        self._hpu_lines: set[int] | None = None
        self._uses: dict[str, list[ast.AST]] | None = None  # name -> the calls of it and loads of it

    def _walk(self, node, context, classes, top):
        for name in STATEMENT_FIELDS:
            for child in getattr(node, name, ()):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualname = ".".join([*context, child.name])
                    self.functions[child.lineno] = Function(qualname, child, classes, top or qualname)
                    self._walk(child, [*context, child.name], classes, top or qualname)
                elif isinstance(child, ast.ClassDef):
                    self._walk(child, [*context, child.name], classes + (child.name,), top)
                else:
                    self._walk(child, context, classes, top)

    def by_name(self, qualname: str) -> Function | None:
        return next((f for f in self.functions.values() if f.qualname == qualname), None)

    # --- the selection's rules ---------------------------------------------------------------------------------

    def selected(self, rule: str) -> list[Function]:
        """The functions the rule picks (selection.py's docstring), in file order."""
        tops = {f.top: f for f in self.functions.values() if f.qualname == f.top}
        keep = {q for q, f in tops.items() if picks(rule, f)}
        return [f for _, f in sorted(self.functions.items()) if f.top in keep]

    # --- lines that need an HPU ------------------------------------------------------------------------------

    def hpu_lines(self) -> set[int]:
        """Statement lines that run on an HPU only (selection.HPU_ONLY): a simple statement that calls or names
        one of those kernels, and every statement in a branch taken only where one imported."""
        if self._hpu_lines is None:
            out: set[int] = set()
            names = {m.split(".")[-1] for m in S.HPU_ONLY}
            # a file that names none of the kernels (transformers' own) has none of those lines: no walk
            for node in ast.walk(self.tree) if any(n in self.text for n in names) else ():
                if isinstance(node, (ast.If, ast.While)) and self.hpu_marker(required(node.test)):
                    out |= {s.lineno for b in node.body for s in ast.walk(b) if isinstance(s, ast.stmt)}
                elif isinstance(node, ast.stmt) and not hasattr(node, "body") and self.hpu_call(node):
                    out.add(node.lineno)
            self._hpu_lines = out
        return self._hpu_lines

    @staticmethod
    def hpu_marker(names) -> str | None:
        return next((m for n in sorted(names) if (m := _matches(n, S.HPU_ONLY))), None)

    @staticmethod
    def hpu_call(node: ast.AST) -> str | None:
        """The HPU-only name a statement calls (`torch.ops.hpu.mixture_of_experts(...)`, `FusedSDPA.apply(...)`)
        or passes to a call (`ModuleFusedSDPA(FusedSDPA)`), if any; a test of it (`FusedSDPA is not None`) runs
        anywhere."""
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            for part in (call.func, *call.args, *(k.value for k in call.keywords)):
                name = dotted(part)
                if name and (marker := _matches(name, S.HPU_ONLY)):
                    return marker
        return None

    # --- why a function was never entered ------------------------------------------------------------------------

    def reasons(self, statements: dict[int, set[int]], entered: set[int], declared: dict[str, Reason]) -> dict[int, Reason]:
        """Why each function the run never entered was not entered, by `def` line. statements: each function's
        statement lines (coverage.py's); entered: the `def` lines of the functions that ran; declared: reasons the
        source cannot show, by qualname (selection.DECLARED)."""
        memo: dict[int, Reason] = {}
        for line in self.functions:
            if line not in entered:
                self._reason(line, statements, entered, declared, memo, set())
        return memo

    def _reason(self, line, statements, entered, declared, memo, seen) -> Reason:
        """needs an HPU: every statement of it needs one, or every place that calls it (or uses its class) is
        in a branch taken only where an HPU kernel imported; an option never set: every such place is in a
        branch of a condition that names one of selection.OPTIONS (or under a string key of a dict: the
        `"flash_attention_2": FalconFlashAttention2` of a model file); either of those inherited from the
        never-entered function around such a place; else not driven."""
        if line in memo:
            return memo[line]
        fn = self.functions[line]
        if fn.qualname in declared:
            memo[line] = declared[fn.qualname]
            return memo[line]
        own = statements.get(line, set())
        if own and own <= self.hpu_lines():
            marker = next((m for s in fn.node.body if (m := self.hpu_call(s))), None)
            memo[line] = Reason(NEEDS_HPU, "every line of it runs on an HPU only", f"it calls {marker}" if marker else "")
            return memo[line]
        seen = seen | {line}
        found = []
        for site in self.sites(fn):
            guard = self.guard(site)
            if guard is None:
                around = self.function_around(site)
                if around is None or around.line in entered or around.line in seen:
                    found = []  # reachable without an option, or from module level: nothing to name
                    break
                inherited = self._reason(around.line, statements, entered, declared, memo, seen)
                if inherited.kind == NOT_DRIVEN:
                    found = []
                    break
                guard = Reason(inherited.kind, inherited.what, f"through {around.qualname}, line {site.lineno}")
            found.append(guard)
        kinds = {g.kind for g in found}
        if found and kinds == {NEEDS_HPU}:
            memo[line] = found[0]
        elif found:
            memo[line] = next(g for g in found if g.kind == OPTION)
        else:
            memo[line] = Reason(NOT_DRIVEN, "no case reached a call of it" if self.sites(fn) or fn.classes else
                                "nothing in this file calls it, and no case called it")
        return memo[line]

    def function_around(self, node: ast.AST) -> Function | None:
        """The innermost function whose body holds `node`."""
        around = [f for f in self.functions.values() if f.node.lineno < node.lineno <= f.node.end_lineno]
        return max(around, key=lambda f: f.node.lineno, default=None)

    def sites(self, fn: Function) -> list[ast.AST]:
        """The places in this file that call `fn` by its name, or (`forward` and the dunder methods, which run
        by using their class) that use its class by name: outside `fn` itself (a type hint uses nothing)."""
        if self._uses is None:
            self._uses = {}
            for node in ast.walk(self.tree):
                name = None
                if isinstance(node, ast.Call):
                    name = node.func.id if isinstance(node.func, ast.Name) else \
                        node.func.attr if isinstance(node.func, ast.Attribute) else None
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and \
                        self.parents[node][1] not in ("annotation", "returns"):
                    name = node.id
                if name:
                    self._uses.setdefault(name, []).append(node)
        implicit = fn.classes and (fn.name == "forward" or fn.name.startswith("__"))  # run by using the class
        names = {fn.classes[-1]} if implicit else {fn.name}
        first, last = fn.node.lineno, fn.node.end_lineno
        return [n for name in sorted(names) for n in self._uses.get(name, ()) if not first <= n.lineno <= last]

    def guard(self, node: ast.AST) -> Reason | None:
        """The nearest condition around `node` whose branch it is in, where that branch needs an HPU kernel
        imported or an option set (or `node` is a value under a string key of a dict); None otherwise."""
        child = node
        while child in self.parents:
            parent, where = self.parents[child]
            if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and where in ("body", "orelse"):
                need = required(parent.test, positive=where == "body")
                if (marker := self.hpu_marker(need)) is not None:
                    return Reason(NEEDS_HPU, f"used only where {marker} imported", f"line {parent.lineno}")
                option = next((o for o in S.OPTIONS if o in need), None)
                if option is not None:
                    return Reason(OPTION, option, f"called only under the condition at line {parent.lineno}")
            if isinstance(parent, ast.Dict) and where == "values":
                key = parent.keys[parent.values.index(child)]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    return Reason(OPTION, repr(key.value), f"used only under that key of the dict at line {parent.lineno}")
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                return None
            child = parent
        return None

def picks(rule: str, fn: Function) -> bool:
    """Whether `rule` selects the outermost function `fn` (selection.py's docstring)."""
    low = lambda s: s.lower()  # noqa: E731
    if rule == "all":
        return True
    if rule == "attention":
        if fn.classes:
            return any(m in low(fn.classes[0]) for m in S.ATTENTION_CLASSES) or \
                any(m in low(fn.name) for m in S.CACHE_METHODS)
        return any(m in low(fn.name) for m in S.ATTENTION_FUNCTIONS)
    if rule == "cache":
        return any(m in low(n) for n in names_in(fn.node) for m in S.CACHE_NAMES)
    raise ValueError(f"unknown rule {rule!r}: expected all, attention or cache")
