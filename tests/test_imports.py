"""The package's import graph: no circle, and FSDP2 only when it is used."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import skorch_gradacc

PACKAGE = Path(skorch_gradacc.__file__).parent


def module_level_imports(path):
    """Yield the skorch_gradacc modules that a module imports when loaded.

    Imports inside functions (e.g. the lazy ``FullyShardedGradAccMixin``)
    run only when called, so they are left out.
    """
    def visit(statements):
        for node in statements:
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == 'skorch_gradacc':
                    yield from ('skorch_gradacc.' + alias.name
                                for alias in node.names)
                elif node.module.startswith('skorch_gradacc.'):
                    yield node.module
            elif isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names
                            if alias.name.startswith('skorch_gradacc.'))
            elif isinstance(node, (ast.If, ast.Try)):
                for block in ('body', 'orelse', 'finalbody'):
                    yield from visit(getattr(node, block, []))
                for handler in getattr(node, 'handlers', []):
                    yield from visit(handler.body)

    yield from visit(ast.parse(path.read_text()).body)


def import_graph():
    modules = {'skorch_gradacc.' + path.stem: path
               for path in PACKAGE.glob('*.py') if path.stem != '__init__'}
    return {name: {imported for imported in module_level_imports(path)
                   if imported in modules}
            for name, path in modules.items()}


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    # the DDP mixin imports its engine and the features it shares with
    # FSDP's mixin, never FSDP2 (that is loaded lazily)
    assert graph['skorch_gradacc.distributed'] == {
        'skorch_gradacc.checkpoints', 'skorch_gradacc.engine',
        'skorch_gradacc.rank_streams', 'skorch_gradacc.sharded_evaluation'}
    done, path = set(), []

    def visit(name):
        assert name not in path, 'import circle: ' + ' -> '.join(
            path[path.index(name):] + [name])
        if name in done:
            return
        path.append(name)
        for imported in graph[name]:
            visit(imported)
        path.pop()
        done.add(name)

    for name in graph:
        visit(name)


@pytest.mark.slow  # a fresh interpreter imports torch
def test_importing_the_package_leaves_fsdp_alone():
    code = (
        "import sys, skorch_gradacc\n"
        "assert not [m for m in sys.modules if 'fsdp' in m], 'imported'\n"
        "from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin\n"
        "assert skorch_gradacc.FullyShardedGradAccMixin is "
        "FullyShardedGradAccMixin\n"
        "from skorch_gradacc.distributed import FullyShardedGradAccMixin as F\n"
        "assert F is FullyShardedGradAccMixin\n"
        "assert 'torch.distributed.fsdp' in sys.modules\n")
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
