"""The project's modules import each other without a circle, and a library module imports another
project module inside a function only to keep an optional dependency optional (swebench for the
SWE task, vLLM for its engine).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_imports.py
"""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {os.path.splitext(os.path.basename(p))[0]: p for p in glob.glob(os.path.join(ROOT, "*.py"))}
SCRIPTS = {"ablations", "bench_async", "bench_memory", "bench_push", "bench_rollout", "bench_update", "gpu_check"}
"""Entry scripts: run, never imported by the library; what they import inside a function is their own affair."""
OPTIONAL = {("train", "swe_task"), ("train", "sandbox"), ("engine", "vllm_engine")}
"""(module, project module it may import inside a function): swe_task needs swebench, vllm_engine vLLM."""


def project_imports(nodes):
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in MODULES:
            yield node.module.split(".")[0]


def trees():
    return {m: ast.parse(open(p, encoding="utf-8").read()) for m, p in MODULES.items()}


def test_the_module_graph_has_no_circle():
    graph = {m: set(project_imports(t.body)) - {m} for m, t in trees().items()}
    done, path = set(), []

    def visit(m):
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + [m])}"
        if m in done:
            return
        path.append(m)
        for dep in sorted(graph[m]):
            visit(dep)
        path.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)
    assert {"train", "rollout", "engine", "config"} <= set(graph)


def test_library_modules_import_the_project_at_the_top():
    late = set()
    for m, tree in trees().items():
        if m in SCRIPTS:
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            late |= {(m, dep) for dep in project_imports(ast.walk(fn))}
    assert late <= OPTIONAL, f"imports inside functions: {sorted(late - OPTIONAL)}"
