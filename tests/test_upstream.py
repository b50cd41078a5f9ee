"""docs/upstream.rst names every private name of skorch, torch or sklearn we use.

The scan reads the source of every module under ``skorch_gradacc/`` with
:mod:`ast`, so that it follows the package as modules are renamed or
split. It collects

* attribute accesses ``x._name`` (loads, stores and deletes),
* the string of ``getattr``, ``hasattr``, ``setattr``, ``delattr`` and
  ``inspect.getattr_static`` calls, ``getattr(x, '_name')``,
* imports of a private module or name from outside the package,
  ``from torch.distributed.distributed_c10d import _get_default_store``,
  ``import torch._dynamo``,

where a name is private if it starts with ``_`` and is not a dunder.

Which of these are upstream's (skorch's, torch's, scikit-learn's, or those
of transformers, Accelerate or Python)? The rule:

1. A private import from outside the package is always upstream's.
2. An attribute is the package's own if the package defines it somewhere:
   a ``def`` or ``class`` at module or class level, a module- or
   class-level assignment, an assignment ``x._name = ...`` or a
   ``setattr(x, '_name', ...)``. So ``net._piece_records_`` and
   ``self._template`` are never flagged, whatever object they are set on;
   a local variable or argument named ``_name`` defines no attribute. An
   attribute the package never defines is upstream's: the package reads,
   calls or deletes what someone else made (``net._optimizers``,
   ``torch._foreach_mul_``, ``sys._getframe``).
3. Defining a name is also how one overrides upstream's, so a definition
   is upstream's after all when

   a. the package defines it but never reads it: only upstream code does,
      it is an attribute upstream reads (``AccumGrad._opt_called``, which
      torch's schedulers read) -- or dead code, to be removed;
   b. it is a method and every definition the package has of it calls
      ``super()`` for the same name: the chain ends outside the package
      (``_validate_params``, ``_get_module``);
   c. (the one check that imports the package) a class of the package
      defines it and an upstream class in its MRO does too -- for a
      ``...Mixin`` without one, skorch's ``NeuralNet``, which such a mixin
      extends: the package overrides it, knowingly or not.

The page lists a name when an entry's first line (its term) has it within
double backquotes, alone or dotted: ``sys._getframe`` lists ``_getframe``.
What the rule misses: an upstream name that the package also defines and
reads itself, without calling ``super()`` for it, on a class that has no
upstream base with it. The planted module below shows what it catches.
"""

import ast
import importlib
import inspect
import pkgutil
import re
from collections import namedtuple
from pathlib import Path

from conftest import has_fsdp2

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / 'skorch_gradacc'
PAGE = ROOT / 'docs' / 'upstream.rst'
OWN = 'skorch_gradacc'
UPSTREAM = ('skorch', 'torch', 'sklearn', 'transformers', 'accelerate')
ATTRIBUTE_FUNCTIONS = {
    'getattr', 'hasattr', 'setattr', 'delattr', 'getattr_static'}

Use = namedtuple('Use', 'path line name how')


def is_private(name):
    return (name.startswith('_') and name.strip('_') != ''
            and not (name.startswith('__') and name.endswith('__')))


class Scan(ast.NodeVisitor):
    """What a set of modules uses and defines of private names."""

    def __init__(self):
        self.uses = []          # Use: attributes, getattr strings, imports
        self.defined = {}       # name -> Use of its first definition
        self.members = []       # Use of each definition in a class body
        self.read = set()       # names the package reads itself
        self.methods = {}       # name -> [calls super() for it, per def]
        self.path = None
        self._classes = []
        self._functions = 0     # depth: a local name defines no attribute

    def scan(self, source, path):
        self.path = path
        self.visit(ast.parse(source, filename=path))
        return self

    def _use(self, node, name, how):
        self.uses.append(Use(self.path, node.lineno, name, how))

    def _define(self, node, name, how):
        self.defined.setdefault(name, Use(self.path, node.lineno, name, how))

    def visit_ClassDef(self, node):
        if is_private(node.name) and not self._functions:
            self._define(node, node.name, 'class')
        for child in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(child)
        self._classes.append(node.name)
        functions, self._functions = self._functions, 0  # attributes here
        for statement in node.body:
            targets = (statement.targets if isinstance(statement, ast.Assign)
                       else [statement.target]
                       if isinstance(statement, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name) and is_private(target.id):
                    self.members.append(Use(
                        self.path, statement.lineno, target.id, 'attribute'))
                    self.methods.setdefault(target.id, []).append(False)
            self.visit(statement)
        self._classes.pop()
        self._functions = functions

    def visit_FunctionDef(self, node):
        if is_private(node.name) and not self._functions:
            self._define(node, node.name, 'def')
            if self._classes:
                self.members.append(
                    Use(self.path, node.lineno, node.name, 'method'))
                self.methods.setdefault(node.name, []).append(
                    calls_super(node))
        for decorator in node.decorator_list:
            # @_name.setter names the property being defined: not a read
            if not (isinstance(decorator, ast.Attribute)
                    and isinstance(decorator.value, ast.Name)
                    and decorator.value.id == node.name):
                self.visit(decorator)
        self.visit(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        classes, self._classes = self._classes, []
        self._functions += 1
        for statement in node.body:
            self.visit(statement)
        self._functions -= 1
        self._classes = classes

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Name(self, node):
        if is_private(node.id):
            if isinstance(node.ctx, ast.Load):
                self.read.add(node.id)
            elif isinstance(node.ctx, ast.Store) and not self._functions:
                self._define(node, node.id, 'name')  # module or class level

    def visit_Attribute(self, node):
        if is_private(node.attr):
            self._use(node, node.attr, 'attribute')
            if isinstance(node.ctx, ast.Load):
                self.read.add(node.attr)
            elif isinstance(node.ctx, ast.Store):
                self._define(node, node.attr, 'assignment')
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        name = (func.id if isinstance(func, ast.Name)
                else func.attr if isinstance(func, ast.Attribute) else None)
        if (name in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)):
            attribute = node.args[1].value
            self._use(node, attribute, name)
            if name == 'setattr':
                self._define(node, attribute, 'setattr')
            else:
                self.read.add(attribute)
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split('.')[0] == OWN:
                continue
            for part in alias.name.split('.'):
                if is_private(part):
                    self._use(node, part, 'import')
            if (alias.asname and is_private(alias.asname)
                    and not self._functions):
                self._define(node, alias.asname, 'import')

    def visit_ImportFrom(self, node):
        module = node.module or ''
        own = node.level > 0 or module.split('.')[0] == OWN
        for alias in node.names:
            if own:
                self.read.add(alias.name)  # the package's own name, used
            else:
                for part in [*module.split('.'), alias.name]:
                    if is_private(part):
                        self._use(node, part, 'import')
            if (alias.asname and is_private(alias.asname)
                    and not self._functions):
                self._define(node, alias.asname, 'import')


def calls_super(function):
    """Whether ``function`` calls ``super().<its name>`` anywhere in it."""
    return any(
        isinstance(node, ast.Attribute) and node.attr == function.name
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == 'super'
        for node in ast.walk(function))


def scan_package(extra=()):
    """Scan every module under skorch_gradacc/, and ``extra`` (path, source)."""
    scan = Scan()
    for path in sorted(PACKAGE.rglob('*.py')):
        scan.scan(path.read_text(encoding='utf-8'),
                  str(path.relative_to(ROOT)))
    for path, source in extra:
        scan.scan(source, path)
    return scan


def upstream_uses(scan):
    """The uses of the rule's upstream private names (module docstring)."""
    found = [use for use in scan.uses
             if use.how == 'import' or use.name not in scan.defined]
    found += [use._replace(how=use.how + ' read only by upstream')
              for use in scan.members if use.name not in scan.read]
    found += [use._replace(how='set, read only by upstream')
              for use in scan.uses if use.how in ('attribute', 'setattr')
              and use.name in scan.defined and use.name not in scan.read]
    found += [use._replace(how='method overriding upstream, via super()')
              for use in scan.members if use.how == 'method'
              and all(scan.methods[use.name])]
    return sorted(set(found))


def page_entries(text=None):
    """Return ``{term: names}`` of the page's entries.

    An entry is a definition-list item: a term line at the margin followed
    by an indented body. ``names``: the private names within double
    backquotes in the term (``sys._getframe`` gives ``_getframe``).
    """
    lines = (PAGE.read_text(encoding='utf-8') if text is None
             else text).splitlines()
    entries = {}
    for line, following in zip(lines, lines[1:]):
        if line.strip() and not line[0].isspace() and following.startswith(
                '   ') and following.strip():
            literals = re.findall(r'``(.+?)``', line)
            entries[line] = {
                name for literal in literals
                for name in re.findall(r'(?<![\w])_\w+', literal)
                if is_private(name)}
    return entries


def entry_bodies(text=None):
    """Return ``{term: body}`` of the page's entries."""
    lines = (PAGE.read_text(encoding='utf-8') if text is None
             else text).splitlines()
    terms, bodies, term = page_entries(text), {}, None
    for line in lines:
        if line.startswith('   ') and term is not None:
            bodies[term] += ' ' + line.strip()
        elif line in terms:
            term = line
            bodies[term] = ''
        else:
            term = None
    return bodies


def unlisted(uses, entries):
    """The failure lines of ``uses`` whose name no entry's term lists."""
    listed = set().union(*entries.values())
    return ['{}:{}: {} ({}) is not in any entry of docs/upstream.rst'.format(
        use.path, use.line, use.name, use.how)
        for use in uses if use.name not in listed]


HINT = ('Use a public API instead, or add an entry to docs/upstream.rst: '
        'its first line names it in double backquotes; then why, "Checked: '
        '<library> <version>", "Hook: <the upstream change that would end '
        'it>", and the upstream issue or PR, or "no issue yet".\n')


def test_every_upstream_private_name_is_on_the_page():
    uses = upstream_uses(scan_package())
    assert uses  # the scan works: the package does use some
    missing = unlisted(uses, page_entries())
    assert not missing, HINT + '\n'.join(missing)


def test_every_override_of_an_upstream_private_name_is_on_the_page():
    from skorch import NeuralNet

    # fully_sharded refuses torch below 2.8 at import (requirements/floor.txt)
    modules = [importlib.import_module(info.name) for info in
               pkgutil.walk_packages([str(PACKAGE)], OWN + '.')
               if has_fsdp2() or info.name != OWN + '.fully_sharded']
    found = []
    for module in modules:
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            bases = [base for base in cls.__mro__
                     if base.__module__.split('.')[0] in UPSTREAM]
            if not bases and cls.__name__.endswith('Mixin'):
                bases = list(NeuralNet.__mro__)
            for name, value in vars(cls).items():
                if is_private(name) and any(
                        name in vars(base) for base in bases):
                    value = getattr(value, 'fget', value)
                    try:
                        line = inspect.getsourcelines(value)[1]
                    except (TypeError, OSError):
                        line = inspect.getsourcelines(cls)[1]
                    path = Path(inspect.getsourcefile(cls))
                    found.append(Use(str(path.relative_to(ROOT)), line, name,
                                     'override in ' + cls.__name__))
    assert found  # _validate_params at least
    missing = unlisted(found, page_entries())
    assert not missing, HINT + '\n'.join(missing)


PLANTED = '''
import torch
from sklearn.utils._param_validation import Interval
from torch import _planted_function as planted


class Planted(torch.optim.Optimizer):
    @property
    def _planted_protocol(self):  # read only by torch
        return self._own

    @_planted_protocol.setter
    def _planted_protocol(self, value):
        self._own = value

    def _planted_override(self):
        return super()._planted_override() + 1


def _helper(net):
    net._planted_attribute.append(getattr(net, '_planted_string', None))
    net._piece_records_ = []
    _planted_local = net._planted_local  # a local defines no attribute
    return net._piece_records_, net.__class__, planted, Interval, _planted_local


_helper(torch._planted_private)
'''


def test_the_scan_catches_planted_private_names():
    path = 'skorch_gradacc/planted.py'
    scan = scan_package(extra=[(path, PLANTED)])
    missing = unlisted(upstream_uses(scan), page_entries())
    expected = {
        (3, '_param_validation'), (4, '_planted_function'),
        (9, '_planted_protocol'), (13, '_planted_protocol'),
        (16, '_planted_override'), (21, '_planted_attribute'),
        (21, '_planted_string'), (23, '_planted_local'),
        (27, '_planted_private')}
    assert {(int(line.split(':')[1]), line.split()[1])
            for line in missing} == expected, missing
    how = {line.split()[1]: line.split('(', 1)[1].split(')')[0]
           for line in missing}
    assert how['_planted_string'] == 'getattr'
    assert how['_param_validation'] == 'import'
    assert how['_planted_protocol'] == 'method read only by upstream'
    assert how['_planted_override'].startswith('method overriding upstream')
    assert all(line.startswith(path + ':') for line in missing)
    # the module alone, with the page's names: the same; the package's own
    # names (_helper, _own, _piece_records_) and dunders are not flagged
    alone = unlisted(upstream_uses(Scan().scan(PLANTED, path)), page_entries())
    assert {line.split()[1] for line in alone} == {
        name for _, name in expected}


def test_a_name_on_the_page_lists_it():
    use = Use('skorch_gradacc/x.py', 1, '_planted_private', 'attribute')
    text = ('T\n=\n\n``torch._planted_private``\n   Why. Checked: torch 2.13.0.'
            ' Hook: one; no issue yet.\n')
    assert unlisted([use], page_entries(text)) == []
    assert unlisted([use], {}) == [
        'skorch_gradacc/x.py:1: _planted_private (attribute) is not in any '
        'entry of docs/upstream.rst']


def test_every_private_name_on_the_page_is_still_used():
    scan = scan_package()
    seen = {use.name for use in scan.uses} | set(scan.defined)
    stale = {term: names - seen for term, names in page_entries().items()
             if names - seen}
    assert not stale, 'no module uses these any more: update the entries'


def test_every_entry_gives_a_version_a_hook_and_its_upstream_status():
    bodies = entry_bodies()
    assert len(bodies) >= 15
    for term, body in bodies.items():
        assert re.search(r'Checked: (skorch|torch|scikit-learn|transformers|'
                         r'Python) \d+\.\d+', body), term
        assert 'Hook: ' in body, term
        assert ('no issue yet' in body or 'no issue needed' in body
                or '<https://github.com/' in body), term
