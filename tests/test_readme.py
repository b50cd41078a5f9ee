"""The README's example and commands work as they stand, so a newcomer can
copy them."""

import json
import re
from pathlib import Path

import pytest

from conftest import background, has_fsdp2, run_readme_notebook

ROOT = Path(__file__).parent.parent
README = ROOT / 'README.md'
DOCS = ROOT / 'docs'
PYPROJECT = ROOT / 'pyproject.toml'
RUN_REQUIREMENTS = ROOT / 'requirements' / 'run.txt'
CPU_INDEX = 'https://download.pytorch.org/whl/cpu'


@pytest.mark.slow
def test_readme_example_runs(capsys):
    blocks = re.findall(r'```python\n(.*?)```', README.read_text(), re.S)
    assert blocks
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), 'exec'), namespace)
    assert namespace['search'].best_params_['net__acc_steps'] in (1, 4, 8)
    assert "{'net__acc_steps':" in capsys.readouterr().out


def test_cpu_only_torch_command_matches_the_pin():
    # the pin is a version; the CPU-only build needs PyTorch's CPU index
    pin = re.search(r'^torch==(\S+)$', RUN_REQUIREMENTS.read_text(), re.M)
    commands = re.findall(
        r'python -m pip install torch==(\S+) --index-url (\S+)\n',
        README.read_text())
    assert commands == [(pin.group(1), CPU_INDEX)]
    assert 'CPU build of torch' not in ' '.join(README.read_text().split())
    assert 'torch==' not in (DOCS / 'installation.rst').read_text()
    assert '--index-url' in installed_section()


def installed_section():
    """The part of the README that installation.rst includes."""
    installation = (DOCS / 'installation.rst').read_text()
    start, end = re.search(
        r'\.\. include:: \.\./README\.md\n\s+:parser: myst_parser\.sphinx_\n'
        r'\s+:start-after: (.+)\n\s+:end-before: (.+)\n', installation).groups()
    readme = README.read_text()
    return readme[readme.index(start):readme.index(end)]


TEST_COMMAND = ('python -m pip install -r requirements/test.txt -e . '
                '&& python -m pytest')


def test_readme_test_command_is_what_ci_runs():
    readme = README.read_text()
    ci = (ROOT / '.ci' / 'run').read_text()
    assert '\n' + TEST_COMMAND + '\n' in ci
    assert '```bash\n' + TEST_COMMAND + '\n```' in readme
    # installation.rst shows the README's commands, included, not copied
    assert TEST_COMMAND in installed_section()
    assert TEST_COMMAND not in (DOCS / 'installation.rst').read_text()
    # a newcomer installs the CPU-only torch before the test requirements
    assert readme.index('--index-url ' + CPU_INDEX) < readme.index(TEST_COMMAND)


def test_benchmark_commands_keep_the_committed_results():
    from benchmarks import run, stream_memory
    modules = [run, stream_memory]
    if has_fsdp2():  # not at requirements/floor.txt's torch 2.3
        from benchmarks import fsdp_memory
        modules.append(fsdp_memory)
    for module in modules:
        assert module.parse_args([]).out == 'benchmark_results', module
    for path, count in ((README, 2), (DOCS / 'benchmarks.rst', 4)):
        commands = re.findall(r'^ *(python -m benchmarks\.\S+ .*)$',
                              path.read_text(), re.M)
        assert len(commands) == count, path
        for command in commands:
            assert '--out benchmark_results' in command, command


def test_license_file_is_bsd_3_clause():
    license_text = (ROOT / 'LICENSE').read_text()
    assert license_text.startswith('BSD 3-Clause License')
    assert 'license = "BSD-3-Clause"' in PYPROJECT.read_text()


def test_no_project_url_of_another_project():
    # skorch's repository is not this project's source
    assert 'github.com/skorch-dev/skorch' not in PYPROJECT.read_text()


@pytest.mark.slow
@pytest.mark.timeout(900)
@background(run_readme_notebook)
def test_notebook_command_runs(readme_notebook):
    # the README's command, on a copy of the notebook, in the test
    # environment (conftest.py; test_notebooks.py checks its outputs)
    proc = readme_notebook.proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [cell for cell in json.loads(readme_notebook.executed.read_text())[
        'cells'] if cell['cell_type'] == 'code']
    assert [cell['execution_count'] for cell in cells] == list(
        range(1, len(cells) + 1))
    assert not any(output['output_type'] == 'error'
                   for cell in cells for output in cell['outputs'])
