"""The package's layout: no import circles among lowprec's modules, the library apart from the
command (``lowprec.cli``), and the command's startup without torch.

The imports are read from the sources with ``ast``, those inside functions too: an import moved
into a function still runs, so it cannot hide a circle (a lazy import is there to keep torch out
of the command's startup, nothing else). Imports under ``if TYPE_CHECKING:`` count too: they do
not run, but a module that names another's types for its annotations depends on it as much as
one that calls it, and a reader follows them the same way.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under src/lowprec: its dotted name -> (its file, whether it is a package)."""
    out = {}
    for path in sorted((SRC / "lowprec").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, package: bool,
             modules: dict[str, tuple[Path, bool]]) -> set[str]:
    """The lowprec modules an import statement of module ``name`` imports."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:  # (a relative import: from its package, or one above per extra dot)
        here = name.split(".") if package else name.split(".")[:-1]
        base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
    out = set()
    for alias in node.names:  # (from P import m: the submodule P.m where there is one, else P)
        sub = f"{base}.{alias.name}"
        if sub in modules:
            out.add(sub)
        elif base in modules:
            out.add(base)
    return out


def _imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, at any depth, ``if TYPE_CHECKING:`` included."""
    return [node for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph() -> dict[str, set[str]]:
    """module -> the lowprec modules it imports (itself left out)."""
    modules = _modules()
    graph = {}
    for name, (path, package) in modules.items():
        graph[name] = set().union(*(_targets(node, name, package, modules)
                                    for node in _imports(path))) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_sees_imports_at_every_depth():
    graph = import_graph()
    assert "lowprec.cli.parser" in graph["lowprec.cli.main"]  # (module level)
    assert "lowprec.cli.compare_cmd" in graph["lowprec.cli.main"]
    assert "lowprec.cli.demos" in graph["lowprec.cli.main"]  # (inside _cmd_numerics)
    assert "lowprec.optim" in graph["lowprec"]  # (under TYPE_CHECKING only)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, f"modules that import each other, directly or around a circle: {found}"


def test_the_step_needs_no_optimizer_type():
    # The step's modules take an optimizer as a core.Stepped (its groups, its state and each
    # group's core.Rule): none imports base or names an optimizer class, and core imports none
    # of them. (The checkpoint runs torch's load hooks, and step_in_backward checks what a user
    # hands it: both take the OptimizerCore.)
    graph = import_graph()
    on_base = sorted(name for name, targets in graph.items() if "lowprec.optim.base" in targets)
    step = {"driver", "buckets", "param_step", "compiled", "shards", "core", "dtensor", "update",
            "loss_scale", "storage", "qstate", "options"}
    assert on_base and not {n for n in on_base if n.removeprefix("lowprec.optim.") in step}
    modules = _modules()
    named = {name for name in step - {"core"}
             if re.search(r"\b(OptimizerCore|LowPrecisionOptimizer)\b",
                          modules[f"lowprec.optim.{name}"][0].read_text())}
    assert not named, f"step modules that name an optimizer type: {sorted(named)}"
    assert not {t for t in graph["lowprec.optim.core"]
                if t.removeprefix("lowprec.optim.") in step - {"dtensor", "loss_scale",
                                                               "storage", "qstate", "options"}}


#: torch's own private members of an optimizer that lowprec reads, each because torch reads it
#: so and has no public reader: the registries of ``load_state_dict`` hooks
#: (``checkpoint.load_state_dict`` runs them as torch's does) and the flag by which
#: ``torch.amp.GradScaler`` finds an optimizer that takes the loss-scaler contract.
TORCH_READS = {"_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
               "_step_supports_amp_scaling"}


def private_reads(source: str, private: set[str]) -> list[str]:
    """Where ``source`` reads one of ``private`` of anything but ``self`` (attributes and
    ``getattr``-like calls), or an instance's ``__dict__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            instance = not (isinstance(node.value, ast.Name) and node.value.id[:1].isupper())
            if not own and (node.attr in private or (node.attr == "__dict__" and instance)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in private):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_core_reads_the_optimizers_private_members():
    # The step's modules, and every other part of the library that takes an optimizer
    # (diagnostics, memory, scaling, the command), read a group's core.Rule, core's functions
    # (core.collect, core.init_state, core.qformats, ...) and core.stages(opt), the typed
    # record of what the step keeps between steps: only lowprec.optim.core, where
    # OptimizerCore is, and the update rules, which implement its interface, read its private
    # members.
    import lowprec.optim
    from lowprec.optim.core import OptimizerCore

    private = {n for n in dir(OptimizerCore) if n.startswith("_") and not n.startswith("__")}
    # (and what the stages kept on the optimizer's __dict__ before core.Stages)
    private |= {"_buckets", "_in_backward", "_shards", "_has_dtensors", "_capturable",
                "_fused_broken", "_seeds_checked", "_shard_offsets", "_shard_reduce",
                "_shard_groups", "_coefficient_cache", "_index_tensors"}
    private -= TORCH_READS
    rules = {type(c).__module__ if not isinstance(c, type) else c.__module__
             for c in vars(lowprec.optim).values()
             if isinstance(c, type) and issubclass(c, OptimizerCore)}
    found = {name: got for name, (path, _) in _modules().items()
             if name not in rules | {"lowprec.optim.core"}
             and (got := private_reads(path.read_text(), private))}
    assert not found, f"reads of the optimizer's private members outside core: {found}"
    # (in core, only OptimizerCore itself, whose rule() hands the step each group's Rule, and
    # stages(), which keeps the step's record in the optimizer's __dict__)
    tree = ast.parse(_modules()["lowprec.optim.core"][0].read_text())
    outside = [node for node in tree.body
               if not (isinstance(node, (ast.ClassDef, ast.FunctionDef))
                       and node.name in ("OptimizerCore", "stages"))]
    got = private_reads(ast.unparse(ast.Module(body=outside, type_ignores=[])), private)
    assert not got, f"core's functions read the optimizer's private members: {got}"
    # (the check sees each kind of read, and leaves self's own and a class's __dict__ alone)
    seen = private_reads("opt._math_buffers(g, p)\ngetattr(opt, '_flags')\nopt.__dict__\n"
                         "self._flags(g)\nCppVecOverrides.__dict__\n", private)
    assert sorted(s.split(":")[0] for s in seen) == ["1", "2", "3"], seen
    assert "lowprec.optim.driver" not in rules and "lowprec.optim.adamw" in rules


def test_the_library_imports_nothing_of_the_command():
    # lowprec.cli builds on the library; the library (lowprec.optim, recipes, memory, ...) must
    # not need the command's modules.
    wrong = {name: sorted(t for t in targets if t.startswith("lowprec.cli"))
             for name, targets in import_graph().items()
             if not name.startswith("lowprec.cli") and name != "lowprec.__main__"}
    assert not {k: v for k, v in wrong.items() if v}


def test_the_command_starts_without_torch():
    # lowprec --help waits for no torch: the package, its entry point, options and defaults.
    code = ("import sys\nimport lowprec.cli, lowprec.cli.main, lowprec.cli.parser, "
            "lowprec.comparison.config, lowprec.cli.compare_cmd\n"
            "print('torch imported:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "torch imported: False", proc.stdout + proc.stderr
