"""The package keeps the shape of issue 34: few modules, light docstrings,
short messages, exports equal to the API reference, no import circle; and
issues 43 and 44's sizes: the planner fits on a page, the mixin reads like
skorch's.

``python tests/test_structure.py`` prints the figures.
"""

import ast
import io
import re
import statistics
import tokenize
from pathlib import Path

import pytest

import skorch_gradacc

PACKAGE = Path(skorch_gradacc.__file__).parent
API = PACKAGE.parent / 'docs' / 'api.rst'

# 15, and homes of their own for the measurement of memory (meters),
# the parameters' checks and signature (params), mixed precision and
# skipped steps (precision): issues 43 and 44
MAX_MODULES = 17
# issue 43: memory.py's lines of code, its planning function's; issue 44:
# GradAccMixin's lines (skorch's AccelerateMixin has 292)
MAX_MEMORY_CODE, MAX_PLAN_CODE, MAX_MIXIN_LINES = 350, 60, 500
MAX_DOCSTRING_RATIO = 0.65
MAX_MESSAGE_WORDS = 40
MESSAGE_CALLS = {'ValueError', 'TypeError', 'RuntimeError', 'warn'}


def modules():
    return sorted(PACKAGE.glob('*.py'))


# Lines of code and of docstrings

def _docstring_nodes(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr)
                    and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                yield first


def line_counts(source):
    """Return ``(code, docstring)`` lines: blanks and comments count as neither."""
    lines = source.splitlines()
    spans = {number for node in _docstring_nodes(ast.parse(source))
             for number in range(node.lineno, node.end_lineno + 1)}
    doc_lines = {number for number in spans if lines[number - 1].strip()}
    code_lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                          tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        code_lines.update(range(token.start[0], token.end[0] + 1))
    return len(code_lines - spans), len(doc_lines)


# Messages of errors and warnings

def _constants(tree):
    """Module-level string constants, for messages kept in a name."""
    found = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            text = _text(node.value, {})
            if text is not None:
                found[node.targets[0].id] = text
    return found


def _text(node, constants):
    """The text of a message expression, a format field counting as a word."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return ''.join(_text(value, constants) or ' VALUE '
                       for value in node.values)
    if isinstance(node, ast.FormattedValue):
        return ' VALUE '
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = _text(node.left, constants)
        right = _text(node.right, constants) if isinstance(node.op, ast.Add) else ''
        return None if left is None else left + (right or '')
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == 'format'):
        return _text(node.func.value, constants)
    return None


def messages(path):
    """Yield ``(line, text)`` for each error raised and warning given."""
    tree = ast.parse(path.read_text())
    constants = _constants(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        name = getattr(func, 'id', None) or getattr(func, 'attr', None)
        if name not in MESSAGE_CALLS:
            continue
        text = _text(node.args[0], constants)
        if text is not None:
            yield node.lineno, text


def word_count(text):
    return len(re.sub(r'\{[^{}]*\}', ' VALUE ', text).split())


# Exports and the API reference

_DIRECTIVE = re.compile(
    r'^\.\. (?P<kind>autoclass|autofunction|automodule|py:data|autodata|'
    r'currentmodule)::\s*(?P<name>\S+)')
_MEMBERS = re.compile(r'^\s+:members:\s*(?P<names>.+)$')


def documented_names(text=None):
    """Return ``{module: names}`` of what ``docs/api.rst`` documents.

    A name documented through the package (``skorch_gradacc.X``) belongs to
    the package and to the module that defines it.
    """
    import importlib
    text = API.read_text() if text is None else text
    current, found, automodule = 'skorch_gradacc', {}, None
    for line in text.splitlines():
        match = _DIRECTIVE.match(line)
        if match:
            kind, name = match['kind'], match['name']
            automodule = None
            if kind == 'currentmodule':
                current = name
            elif kind == 'automodule':
                automodule = name
            else:
                full = name if name.startswith('skorch_gradacc') else (
                    current + '.' + name)
                module, _, attr = full.rpartition('.')
                found.setdefault(module, set()).add(attr)
            continue
        members = _MEMBERS.match(line)
        if members and automodule:
            names = [name.strip() for name in members['names'].split(',')]
            found.setdefault(automodule, set()).update(names)
    for module, names in list(found.items()):
        for name in names:
            home = getattr(getattr(importlib.import_module(module), name),
                           '__module__', module)
            if home != module and home.startswith('skorch_gradacc'):
                found.setdefault(home, set()).add(name)
    return found


def exports():
    """Return ``{module: set(__all__)}`` for the package and its modules.

    As imported: the package's ``__all__`` depends on torch's version.
    """
    import importlib
    found = {}
    for path in modules():
        module = 'skorch_gradacc' + (
            '' if path.stem == '__init__' else '.' + path.stem)
        names = getattr(importlib.import_module(module), '__all__', None)
        if names is not None:
            found[module] = set(names)
    return found


# Import circles

def import_graph():
    """Return ``{module: modules it imports when loaded}`` of the package."""
    names = {'skorch_gradacc.' + path.stem for path in modules()
             if path.stem != '__init__'}
    graph = {}
    for path in modules():
        if path.stem == '__init__':
            continue
        imported = set()
        for node in _loaded(ast.parse(path.read_text()).body):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == 'skorch_gradacc':
                    imported.update('skorch_gradacc.' + alias.name
                                    for alias in node.names)
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph['skorch_gradacc.' + path.stem] = imported & names
    return graph


def _loaded(statements):
    """The import statements that run when a module is loaded."""
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            for block in ('body', 'orelse', 'finalbody'):
                yield from _loaded(getattr(node, block, []))
            for handler in getattr(node, 'handlers', []):
                yield from _loaded(handler.body)


def find_circle(graph):
    """Return one import circle as a list of modules, or None."""
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        path.append(name)
        for imported in sorted(graph[name]):
            circle = visit(imported)
            if circle:
                return circle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name)
        if circle:
            return circle
    return None


def figures():
    code = docs = 0
    words = []
    for path in modules():
        source = path.read_text()
        module_code, module_docs = line_counts(source)
        code += module_code
        docs += module_docs
        words.extend(word_count(text) for _, text in messages(path))
    return {'modules': len(modules()), 'code lines': code,
            'docstring lines': docs, 'ratio': round(docs / code, 3),
            'messages': len(words), 'median words': statistics.median(words),
            'max words': max(words),
            'exports': {module: sorted(names)
                        for module, names in sorted(exports().items())}}


# The tests

def test_at_most_15_modules():
    assert len(modules()) <= MAX_MODULES, [path.name for path in modules()]


def test_the_planner_fits_on_a_page():
    tree = ast.parse((PACKAGE / 'memory.py').read_text())
    code, _ = line_counts((PACKAGE / 'memory.py').read_text())
    plan = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                and node.name == 'plan_memory')
    source = ast.get_source_segment((PACKAGE / 'memory.py').read_text(), plan)
    assert code <= MAX_MEMORY_CODE, code
    assert line_counts(source)[0] <= MAX_PLAN_CODE, line_counts(source)


def test_the_mixin_reads_like_skorchs():
    tree = ast.parse((PACKAGE / 'mixin.py').read_text())
    mixin = next(node for node in tree.body if isinstance(node, ast.ClassDef)
                 and node.name == 'GradAccMixin')
    assert mixin.end_lineno - mixin.lineno + 1 <= MAX_MIXIN_LINES


def test_docstrings_weigh_less_than_the_code():
    counts = [line_counts(path.read_text()) for path in modules()]
    code, docs = (sum(column) for column in zip(*counts))
    assert docs <= MAX_DOCSTRING_RATIO * code, (docs, code)


def test_every_message_is_short():
    long = ['{}:{}: {} words'.format(path.name, line, word_count(text))
            for path in modules() for line, text in messages(path)
            if word_count(text) > MAX_MESSAGE_WORDS]
    assert not long


def test_exports_are_what_the_api_reference_documents():
    try:
        import skorch_gradacc.fully_sharded  # noqa: F401 (api.rst documents it)
    except ImportError:  # torch < 2.8, the floor
        pytest.skip('FSDP2 needs torch>=2.8')
    documented = documented_names()
    exported = exports()
    for module in sorted(set(documented) | set(exported)):
        assert exported.get(module, set()) == documented.get(module, set()), module


def test_no_import_circle():
    assert find_circle(import_graph()) is None


class TestTheChecksCatch:
    """Each check fails on a planted violation."""

    def test_a_long_message(self, tmp_path):
        path = tmp_path / 'bad.py'
        path.write_text('def f(x):\n    raise ValueError(\n        "{} '
                        + 'word ' * 40 + '".format(x))\n')
        [(line, text)] = messages(path)
        assert word_count(text) == 41

    def test_a_message_in_a_constant_and_a_warning(self, tmp_path):
        path = tmp_path / 'bad.py'
        path.write_text('import warnings\nMESSAGE = ("a b " "c")\n'
                        'warnings.warn(MESSAGE, UserWarning)\n')
        assert [word_count(text) for _, text in messages(path)] == [3]

    def test_docstring_lines(self):
        source = ('def f():\n    """One.\n\n    Two.\n    """\n'
                  '    # why\n\n    return 1\n')
        assert line_counts(source) == (2, 3)

    def test_a_circle(self):
        assert find_circle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == [
            'a', 'b', 'c', 'a']
        assert find_circle({'a': {'b'}, 'b': set()}) is None

    def test_an_undocumented_export(self):
        documented = documented_names(
            '.. currentmodule:: skorch_gradacc\n\n'
            '.. autoclass:: GradAccMixin\n\n'
            '.. automodule:: skorch_gradacc.grouping\n'
            '   :members: MicroBatchGroups\n')
        assert documented['skorch_gradacc'] == {'GradAccMixin'}
        assert documented['skorch_gradacc.mixin'] == {'GradAccMixin'}
        assert documented['skorch_gradacc.grouping'] == {'MicroBatchGroups'}


if __name__ == '__main__':
    import pprint
    pprint.pprint(figures(), width=100, sort_dicts=False)
