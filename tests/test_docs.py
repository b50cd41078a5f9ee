"""The documentation builds, and every recipe in it runs.

Each ``.. code-block:: python`` block of ``docs/*.rst`` is executed. Blocks
under the same section heading form one recipe: they run in order in one
fresh namespace, so a recipe may be split by prose but never depends on
another section (each FAQ answer stands alone). A page that is one script
told in sections, like the quick start, says so with the comment
``.. test-docs: one script per page``; its blocks then share one namespace.
A page whose recipes need optional packages names them in the comment
``.. test-docs: requires NAME ...``; without them, its recipes are skipped.
Recipes may import the modules in ``docs/`` that their pages show with
``literalinclude``.
Examples written as doctests (``>>>``) in the pages are run with
:mod:`doctest`. Code in other languages (``bash``, ``text``) is not run.

A recipe fails the test when it raises, and recipes assert what the prose
around them claims (e.g. that parameters match the large-batch net). Error
tracebacks point at the line in the ``.rst`` file.

The Sphinx build is the one ``docs/conf.py`` describes: offline, nitpicky,
with warnings as errors.
"""

import doctest
import re
import sys
import textwrap
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / 'docs'

# A section title is a line of text underlined by one repeated punctuation
# character, at least as long as the text (reStructuredText's rule).
ADORNMENT = re.compile(r'^([=\-~^"\'`#*+:.])\1+\s*$')
CODE_DIRECTIVE = re.compile(
    r'^(?P<indent>[ \t]*)\.\. (?:code-block|code|sourcecode)::\s*(?P<lang>\S*)\s*$')
PYTHON_LANGUAGES = {'python', 'python3', 'py'}
ONE_SCRIPT = re.compile(r'^\.\. test-docs: one script per page\s*$', re.M)
REQUIRES = re.compile(r'^\.\. test-docs: requires (?P<names>.+?)\s*$', re.M)


class Block:
    """A Python code block: its page, section, first line, and source."""

    def __init__(self, path, section, lineno, source):
        self.path = path
        self.section = section
        self.lineno = lineno
        self.source = source


def _indent(line):
    return len(line) - len(line.lstrip())


def extract_blocks(path):
    """Return the Python code blocks of one ``.rst`` page, in order.

    ``lineno`` is the 1-based line of the block's first code line in the
    page, so that compiled code can report the page's line numbers.
    """
    lines = Path(path).read_text(encoding='utf-8').splitlines()
    blocks = []
    section = '(top of page)'
    i = 0
    while i < len(lines):
        line = lines[i]
        following = lines[i + 1] if i + 1 < len(lines) else ''
        text = line.strip()
        if (text and not line[0].isspace() and not ADORNMENT.match(line)
                and ADORNMENT.match(following)
                and len(following.rstrip()) >= len(text)):
            section = text
            i += 2
            continue

        match = CODE_DIRECTIVE.match(line)
        if not match:
            i += 1
            continue
        directive_indent = len(match.group('indent'))
        language = match.group('lang').lower()
        i += 1
        # the directive's options (":linenos:" and the like) come first
        while i < len(lines) and lines[i].strip().startswith(':') and (
                _indent(lines[i]) > directive_indent):
            i += 1
        body = []
        first = None
        while i < len(lines):
            current = lines[i]
            if current.strip() and _indent(current) <= directive_indent:
                break
            if first is None and current.strip():
                first = i + 1
            if first is not None:
                body.append(current)
            i += 1
        if language in PYTHON_LANGUAGES and first is not None:
            source = textwrap.dedent('\n'.join(body)).strip('\n') + '\n'
            blocks.append(Block(Path(path), section, first, source))
    return blocks


def recipes():
    """All recipes of all pages: ``(page, section, [blocks])`` in order."""
    found = []
    for path in sorted(DOCS.glob('*.rst')):
        one_script = ONE_SCRIPT.search(path.read_text(encoding='utf-8'))
        by_section = {}
        for block in extract_blocks(path):
            section = '(whole page)' if one_script else block.section
            by_section.setdefault(section, []).append(block)
        found.extend((path, section, blocks)
                     for section, blocks in by_section.items())
    return found


RECIPES = recipes()


def required_packages(path):
    """The packages that a page's ``test-docs: requires`` comments name."""
    text = Path(path).read_text(encoding='utf-8')
    return [name for match in REQUIRES.finditer(text)
            for name in match.group('names').split()]


def run_recipe(blocks, name='docs_recipe'):
    """Run the blocks of one recipe in order, in one fresh module namespace.

    The namespace is registered as a module while it runs, so that classes
    defined in a recipe can be pickled and cloned like any user code.
    """
    module = types.ModuleType(name)
    module.__file__ = str(blocks[0].path)
    sys.modules[name] = module
    try:
        for block in blocks:
            # leading newlines make tracebacks show the page's line numbers
            code = compile('\n' * (block.lineno - 1) + block.source,
                           str(block.path), 'exec')
            exec(code, module.__dict__)
    finally:
        del sys.modules[name]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Restore the global state that recipes may change, and run in tmp.

    The modules beside the pages in ``docs/`` are importable, as for a
    reader who saved them beside their script.
    """
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(DOCS))
    torch_rng = torch.get_rng_state()
    numpy_rng = np.random.get_state()
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    # The recipes' models are tiny: one thread is fastest, and avoids the
    # slow-down of spinning OpenMP threads on a busy machine.
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        yield tmp_path
    torch.set_rng_state(torch_rng)
    np.random.set_state(numpy_rng)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    if 'accelerate' in sys.modules:
        # Accelerator() keeps process-wide singletons; later tests must not
        # inherit a recipe's gradient_accumulation_steps.
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    if 'matplotlib.pyplot' in sys.modules:
        sys.modules['matplotlib.pyplot'].close('all')


@pytest.mark.slow
@pytest.mark.parametrize('path, section, blocks', [
    # the memory page measures its fits' peaks: in a process of its own
    pytest.param(path, section, blocks, id='{}::{}'.format(path.name, section),
                 marks=[pytest.mark.own_process] * (
                     path.name == 'memory_and_robustness.rst'))
    for path, section, blocks in RECIPES])
def test_recipe_runs(path, section, blocks, isolated):
    for name in required_packages(path):
        pytest.importorskip(name)
    run_recipe(blocks)


def test_doctest_examples_in_pages_pass(isolated):
    for path in sorted(DOCS.glob('*.rst')):
        result = doctest.testfile(
            str(path), module_relative=False, verbose=False, report=True,
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, path.name


class TestExtraction:
    """The extraction finds the recipes, so the tests above can fail."""

    def test_every_faq_question_has_a_recipe(self):
        faq = DOCS / 'faq.rst'
        sections = [section for path, section, _ in RECIPES if path == faq]
        assert len(sections) >= 4
        for section in sections:
            assert section.endswith('?'), section

    def test_pages_with_recipes(self):
        pages = {path.name for path, _, _ in RECIPES}
        assert {'quickstart.rst', 'memory_and_robustness.rst',
                'schedules_and_precision.rst', 'faq.rst',
                'searching.rst'} <= pages

    def test_pages_name_their_optional_packages(self):
        assert required_packages(DOCS / 'fine_tuning_transformers.rst') == [
            'transformers', 'tokenizers']
        assert required_packages(DOCS / 'faq.rst') == []
        assert required_packages(DOCS / 'searching.rst') == [
            'optuna', 'optuna_integration']

    def test_blocks_split_by_section_keep_page_line_numbers(self, tmp_path):
        page = tmp_path / 'page.rst'
        page.write_text(textwrap.dedent('''\
            Title
            =====

            How do I fail?
            --------------

            Text.

            .. code-block:: python
               :caption: a caption

               x = 1

            More text.

            .. code-block:: python

                assert x == 2

            .. code-block:: bash

               echo not python

            Other section
            -------------

            .. code:: python

               y = 3
            '''))
        blocks = extract_blocks(page)
        assert [(b.section, b.lineno, b.source) for b in blocks] == [
            ('How do I fail?', 12, 'x = 1\n'),
            ('How do I fail?', 18, 'assert x == 2\n'),
            ('Other section', 29, 'y = 3\n'),
        ]
        # a broken recipe fails, and the traceback names the page's line
        with pytest.raises(AssertionError) as excinfo:
            run_recipe(blocks[:2])
        assert excinfo.traceback[-1].lineno + 1 == 18
        assert str(excinfo.traceback[-1].path) == str(page)


# myst-parser itself uses a Sphinx API that Sphinx 9 deprecates
@pytest.mark.slow
@pytest.mark.filterwarnings(
    'ignore:.*is deprecated. Check CHANGES for Sphinx API modifications')
def test_docs_build_offline_without_warnings(tmp_path, monkeypatch):
    from sphinx.cmd.build import build_main

    monkeypatch.delenv('SKORCH_GRADACC_INTERSPHINX', raising=False)
    warning_file = tmp_path / 'warnings.txt'
    status = build_main([
        '-W', '-n', '--keep-going', '-q', '-b', 'html',
        '-d', str(tmp_path / 'doctrees'), '-w', str(warning_file),
        str(DOCS), str(tmp_path / 'html'),
    ])
    warnings_text = (warning_file.read_text() if warning_file.exists()
                     else '')
    assert status == 0, warnings_text
    assert warnings_text == ''
    for page in ('index', 'installation', 'quickstart', 'how_it_works',
                 'faq', 'api', 'changes'):
        assert (tmp_path / 'html' / (page + '.html')).exists(), page
    api = (tmp_path / 'html' / 'api.html').read_text(encoding='utf-8')
    import skorch_gradacc
    for name in skorch_gradacc.__all__:
        if name != '__version__':
            assert 'skorch_gradacc.' + name in api, name
    assert 'track_activation_memory' in api


def test_docs_build_is_nitpicky_about_this_package_only(monkeypatch):
    """Every reference must resolve; only other projects' names, which
    intersphinx links when it is on, may stay unresolved offline."""
    import runpy

    monkeypatch.setattr(sys, 'path', list(sys.path))  # conf.py inserts one
    conf = runpy.run_path(str(DOCS / 'conf.py'))
    assert conf['nitpicky'] is True
    assert not conf.get('nitpick_ignore')
    patterns = conf['nitpick_ignore_regex']
    for reftype, target in [('py:class', 'torch.nn.Module'),
                            ('py:func', 'copy.deepcopy'),
                            ('py:class', 'skorch.NeuralNet'),
                            ('py:class', 'sklearn.pipeline.Pipeline')]:
        assert any(re.fullmatch(kind, reftype) and re.fullmatch(name, target)
                   for kind, name in patterns), target
    for target in ('skorch_gradacc.engine.DDPEngine', 'DDPEngine',
                   'ItemCounts', 'plan_memory', 'PLAN_MARGIN'):
        assert not any(re.fullmatch(name, target)
                       for _, name in patterns), target


def test_api_names_every_parameter_of_every_net():
    """api.rst's list of the mixin's parameters is complete, and each is
    documented in the mixin's docstring and taken by every net."""
    import inspect

    import skorch_gradacc
    from skorch_gradacc import GradAccMixin

    own = [name for name, param in
           inspect.signature(GradAccMixin.__init__).parameters.items()
           if param.kind is param.KEYWORD_ONLY]
    assert own
    api = (DOCS / 'api.rst').read_text(encoding='utf-8')
    listed = re.search(r'plus the mixin\'s (\w+)[,:]', api)
    assert listed and listed.group(1) == {
        1: 'one', 2: 'two', 3: 'three', 4: 'four', 5: 'five',
        6: 'six'}[len(own)]
    for name in own:
        assert '``{}``'.format(name) in api, name
        assert '\n    {} : '.format(name) in GradAccMixin.__doc__, name
        for net in ('GradAccNeuralNet', 'GradAccNeuralNetClassifier',
                    'GradAccNeuralNetBinaryClassifier',
                    'GradAccNeuralNetRegressor'):
            cls = getattr(skorch_gradacc, net)
            assert name in inspect.signature(cls).parameters, (net, name)


def resume_recipe():
    """The FAQ's resume recipe: its definitions, and the rest."""
    [blocks] = [blocks for path, section, blocks in RECIPES
                if path.name == 'faq.rst' and section.startswith(
                    'How do I resume a fit')]
    source = ''.join(block.source for block in blocks)
    end = source.index("uninterrupted = train(")
    return source[:end], source[end:]


def test_resume_recipe_shuffles_drops_out_and_compares():
    # the FAQ's resume recipe (run by test_recipe_runs) resumes a fit that
    # shuffles and drops out, and asserts it equals the uninterrupted fit
    definitions, calls = resume_recipe()
    assert 'iterator_train__shuffle=True' in definitions
    assert 'make_classifier(' in definitions  # dropout=0.5 by default
    assert "train('resumed', max_epochs=2)" in calls
    assert 'max_diff(resumed, uninterrupted) == 0' in calls


@pytest.mark.slow
def test_resume_recipe_needs_no_random_state_under_ddp(isolated):
    """scaling_out.rst: the FAQ's resume script, with a DDP net and skorch's
    plain Checkpoint, resumes exactly: each rank saves its random state."""
    import torch.distributed as dist
    from skorch.callbacks import Checkpoint

    from skorch_gradacc import (
        DistributedGradAccMixin,
        GradAccNeuralNetClassifier,
    )

    class DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier):
        pass

    definitions, _ = resume_recipe()
    recipe = {}
    exec(compile(definitions, 'faq.rst', 'exec'), recipe)
    recipe['GradAccNeuralNetClassifier'] = DDPNet  # the net train() builds
    train, max_diff = recipe['train'], recipe['max_diff']
    dist.init_process_group('gloo', init_method=(isolated / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        uninterrupted = train('uninterrupted', checkpoint=Checkpoint)
        train('resumed', max_epochs=2, checkpoint=Checkpoint)
        assert (isolated / 'resumed' / 'params_random_state_rank0.pt').exists()
        resumed = train('resumed', checkpoint=Checkpoint)
    finally:
        dist.destroy_process_group()
    assert len(resumed.history) == 4
    assert max_diff(resumed, uninterrupted) <= 1e-10


def test_allreduces_per_step_are_as_documented(tmp_path, monkeypatch):
    """scaling_out.rst: per optimizer step, one gradient all-reduce per DDP
    bucket (one for a small model) and one all-reduce of three numbers:
    the item count, the loss sum and the rows."""
    import torch.distributed as dist
    from sklearn.datasets import make_classification

    from skorch_gradacc import (
        DistributedGradAccMixin,
        GradAccNeuralNetClassifier,
    )

    class DDPNet(DistributedGradAccMixin, GradAccNeuralNetClassifier):
        pass

    sizes = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, 'all_reduce', counting_all_reduce)
    X, y = make_classification(202, 10, random_state=0)
    dist.init_process_group('gloo', init_method=(tmp_path / 'store').as_uri(),
                            rank=0, world_size=1)
    try:
        net = DDPNet(torch.nn.Linear, module__in_features=10,
                     module__out_features=2,
                     criterion=torch.nn.CrossEntropyLoss, batch_size=8,
                     acc_steps=3, max_epochs=2, train_split=None, verbose=0)
        net.fit(X.astype(np.float32), y)
    finally:
        dist.destroy_process_group()
    steps = sum(net.history[:, 'train_batch_count'])
    assert steps == 2 * 9  # ceil(202 / 24) steps an epoch
    assert net.engine_.allreduces == steps  # one bucket
    assert sizes.count(3) == steps  # item count, loss sum and rows
    assert sizes.count(10 * 2 + 2) == steps  # the gradient bucket
    assert len(sizes) == 2 * steps


def test_how_it_works_lists_every_method_the_mixin_overrides():
    """how_it_works.rst names each NeuralNet method that GradAccMixin (or a
    class it derives from) overrides, and no other."""
    from skorch import NeuralNet

    from skorch_gradacc import GradAccMixin

    text = ' '.join((DOCS / 'how_it_works.rst').read_text().split())
    paragraph = text.split("Of skorch's ``NeuralNet`` methods, the mixin "
                           "overrides")[1].split('Your own overrides')[0]
    listed = set(re.findall(r'``(\w+)``', paragraph)) - {
        'micro_batch_size', 'acc_steps'}
    overridden = {
        name for cls in GradAccMixin.__mro__ if cls is not object
        for name in vars(cls)
        if not name.startswith('__') and hasattr(NeuralNet, name)}
    assert listed == overridden


def test_history_table_lists_every_key_the_package_records():
    """how_it_works.rst's table holds every history key the code writes."""
    source = ' '.join(
        path.read_text() for path in (DOCS.parent / 'skorch_gradacc').glob(
            '*.py'))
    recorded = set(re.findall(
        r"(?:\.record|\.record_batch)\(\s*'(\w+)'|row\['(\w+)'\]\s*=", source))
    recorded = {name for pair in recorded for name in pair if name}
    table = (DOCS / 'how_it_works.rst').read_text().split('\nHistory\n')[1]
    listed = set(re.findall(r'^``(\w+)``\s+(?:epoch|batch)\b', table, re.M))
    assert recorded and listed == recorded


def test_docs_stay_within_their_line_budget():
    """The pages, README and CHANGES stay the size of the code (issue 20)."""
    root = DOCS.parent
    lines = {path.name: len(path.read_text(encoding='utf-8').splitlines())
             for path in [*DOCS.glob('*.rst'), root / 'README.md',
                          root / 'CHANGES.md']}
    assert sum(lines.values()) <= 2200, lines
    assert lines['README.md'] <= 110
