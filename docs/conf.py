"""Sphinx configuration for skorch-gradacc.

The documentation builds offline, with warnings as errors::

    python -m sphinx -W -b html docs docs/_build/html

``tests/test_docs.py`` runs exactly this build and executes every Python code
block of the pages.

Links into the Python, PyTorch, skorch and scikit-learn documentation
(intersphinx) need their ``objects.inv`` inventories, i.e. the network. They
are therefore off by default, so that an offline build (CI, the test suite)
neither waits for a download nor fails on it. To build the published docs
with those links, set ``SKORCH_GRADACC_INTERSPHINX=1``::

    SKORCH_GRADACC_INTERSPHINX=1 python -m sphinx -W -b html docs docs/_build/html

The build is ``nitpicky``: a reference to a name that the docs do not
document is a warning, hence an error. Without intersphinx, references to
the names of torch, skorch, scikit-learn, numpy and the standard library,
such as :class:`torch.nn.BatchNorm1d`, render as plain code;
``nitpick_ignore_regex`` keeps them from warning, and only them: a name of
this package that a page or a public docstring references must be
documented in ``api.rst`` (a class's internal bases show as code).
"""

import os
import sys
from pathlib import Path

# Document the package of this checkout, installed or not.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import skorch_gradacc  # noqa: E402

project = 'skorch-gradacc'
author = 'skorch-gradacc developers'
copyright = '2025, skorch-gradacc developers'
release = skorch_gradacc.__version__
version = release

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.viewcode',
    'numpydoc',
    'myst_parser',
]

source_suffix = {'.rst': 'restructuredtext'}
root_doc = 'index'
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store']
templates_path = []
html_static_path = []
html_theme = 'alabaster'

# autodoc: members in source order; numpydoc renders the docstrings and must
# not add its own member tables (they would need autosummary stubs).
autodoc_member_order = 'bysource'
autodoc_default_options = {'show-inheritance': True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

nitpicky = True
# Other projects' names: intersphinx links them when it is on.
EXTERNAL = ['torch', 'skorch', 'sklearn', 'numpy',
            *sorted(sys.stdlib_module_names)]
nitpick_ignore_regex = [
    (r'py:.*', r'(?:{})(?:\..+)?'.format('|'.join(EXTERNAL))),
]

# CHANGES.md is included by changes.rst, and the README's commands by
# installation.rst, through myst_parser; the README's sections are H2.
myst_heading_anchors = 2
suppress_warnings = ['myst.header']

if os.environ.get('SKORCH_GRADACC_INTERSPHINX') == '1':
    extensions.append('sphinx.ext.intersphinx')
    intersphinx_mapping = {
        'python': ('https://docs.python.org/3', None),
        'torch': ('https://docs.pytorch.org/docs/stable', None),
        'skorch': ('https://skorch.readthedocs.io/en/stable', None),
        'sklearn': ('https://scikit-learn.org/stable', None),
    }
    intersphinx_timeout = 30



# CHANGES.md links to files relative to the repository root, which is what
# GitHub renders. Inside these docs, point those links at the pages instead:
# ``docs/how_it_works.rst`` is the page ``how_it_works``, and the README's
# commands (installation, the demo, the tests) are on the installation
# page. MyST turns such links into pending cross-references; they are
# rewritten after reading, before Sphinx resolves them.
CHANGES_LINKS = {'README.md': 'installation'}


def _rewrite_changes_links(app, doctree):
    from sphinx.addnodes import pending_xref

    for node in doctree.findall(pending_xref):
        if node.get('reftype') != 'myst' or node.get('refdomain'):
            continue
        target = node['reftarget']
        target = CHANGES_LINKS.get(target, target)
        if target.startswith('docs/'):
            target = target[len('docs/'):].rsplit('.', 1)[0]
        if target in app.env.found_docs:
            # what MyST itself makes of a link to a document
            node['refdomain'] = 'doc'
            node['reftarget'] = target
            node['reftargetid'] = None


def _literal_internal_bases(app, name, obj, options, bases):
    """Show a class's internal bases as code, not as references.

    The API reference documents only the names in a module's ``__all__``.
    """
    for i, base in enumerate(bases):
        module = getattr(base, '__module__', '')
        if (module.split('.')[0] == 'skorch_gradacc' and base.__name__
                not in getattr(sys.modules[module], '__all__', ())):
            bases[i] = '``{}.{}``'.format(module, base.__qualname__)


def setup(app):
    """Register the link rewriting for CHANGES.md, and the internal bases."""
    app.connect('doctree-read', _rewrite_changes_links)
    app.connect('autodoc-process-bases', _literal_internal_bases)
