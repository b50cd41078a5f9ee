"""The notebooks run top to bottom, and are committed with their outputs.

Each notebook in ``notebooks/`` is executed with nbclient in a fresh kernel,
in a process of its own that runs in the background from the collection's
end (conftest.py), but the one that the README's command runs: that command
runs it once, for test_readme.py and this module (``run_readme_notebook``
in conftest.py), with the same kernel. The kernel is this interpreter
(``sys.executable``), whatever Jupyter kernels the machine has: the test
writes its own ``python3`` kernelspec into a temporary ``JUPYTER_PATH``
entry, which Jupyter searches first. It needs only ``ipykernel`` installed
in this environment, which ``requirements/test.txt`` pins. The checkout is
put on the kernel's ``PYTHONPATH``, so the notebooks use this checkout's
package even where it is not installed.
"""

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / 'notebooks').glob('*.ipynb'))
KERNEL_NAME = conftest.KERNEL_NAME
CELL_TIMEOUT = 240  # seconds; the whole notebook takes well under a minute
# optional packages that a notebook needs; without them it is not run
REQUIRES = {'Fine_Tuning_Transformers.ipynb': ('transformers', 'tokenizers')}


def execute(path):
    """Execute the notebook ``path`` with nbclient in a fresh kernel, in a
    process of its own (the kernel's environment is that of
    :func:`conftest.kernel_env`): the process and the executed copy."""
    folder = conftest.background_folder(path.stem)
    env = conftest.kernel_env(folder)
    executed = folder / path.name
    code = (
        'import sys, nbclient, nbformat\n'
        'notebook = nbformat.read(sys.argv[1], as_version=4)\n'
        'client = nbclient.NotebookClient(\n'
        '    notebook, kernel_name={!r}, timeout={!r}, startup_timeout=120,\n'
        "    resources={{'metadata': {{'path': sys.argv[2]}}}})\n"
        'try:\n'
        '    client.execute()\n'
        'finally:  # what ran, the error included\n'
        '    nbformat.write(notebook, sys.argv[3])\n').format(
            KERNEL_NAME, CELL_TIMEOUT)
    proc = subprocess.run(
        [sys.executable, '-c', code, str(path), str(folder), str(executed)],
        env=env, capture_output=True, text=True, timeout=900)
    return SimpleNamespace(proc=proc, executed=executed)


README_NOTEBOOK = ROOT / conftest.readme_notebook_command()[1]
# each notebook's run: the README's command runs its notebook (conftest.py)
RUNS = {path: conftest.run_readme_notebook if path == README_NOTEBOOK
        else functools.partial(execute, path) for path in NOTEBOOKS}


def runnable(path):
    """The notebook, marked to run in the background where it can run."""
    if all(importlib.util.find_spec(name)
           for name in REQUIRES.get(path.name, ())):
        return pytest.param(path, marks=conftest.background(RUNS[path]))
    return path


def read(path):
    return nbformat.read(str(path), as_version=4)


def test_there_are_notebooks():
    assert [path.name for path in NOTEBOOKS] == [
        'Fine_Tuning_Transformers.ipynb', 'Gradient_Accumulation.ipynb']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda path: path.name)
class TestNotebook:
    def test_starts_with_a_title_cell(self, path):
        first = read(path).cells[0]
        assert first.cell_type == 'markdown'
        assert first.source.startswith('# ')

    def test_committed_with_outputs_run_top_to_bottom(self, path):
        code_cells = [cell for cell in read(path).cells
                      if cell.cell_type == 'code']
        counts = [cell.execution_count for cell in code_cells]
        assert counts == list(range(1, len(code_cells) + 1)), (
            'execute the notebook top to bottom and commit it with outputs')
        for cell in code_cells:
            assert not any(output.output_type == 'error'
                           for output in cell.outputs)


# each notebook runs in the background from the collection's end (conftest.py)
@pytest.mark.parametrize('path', [runnable(path) for path in NOTEBOOKS],
                         ids=lambda path: path.name)
def test_runs_top_to_bottom(path):
    for name in REQUIRES.get(path.name, ()):
        pytest.importorskip(name)
    committed = read(path)
    # a cell that raised: nbclient's CellExecutionError, with the cell and
    # its traceback, ends stderr
    run = conftest.background_result(RUNS[path])
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    notebook = read(run.executed)

    outputs = [output for cell in notebook.cells
               if cell.cell_type == 'code' for output in cell.outputs]
    images = [output for output in outputs
              if 'image/png' in output.get('data', {})]
    tables = [output for output in outputs
              if 'text/html' in output.get('data', {})]
    assert len(images) >= 2  # loss curves, memory against acc_steps
    assert tables  # the DataFrames, cv_results_ among them
    # a cell that reads the committed benchmark results shows them as
    # they are, not as they were when the notebook last ran
    quoting = [(old, new) for old, new in zip(committed.cells, notebook.cells)
               if old.cell_type == 'code' and "'results'" in old.source]
    if path.name == 'Gradient_Accumulation.ipynb':
        assert quoting  # the LM head's memory, from stream_memory_sweep
    for old, new in quoting:
        assert _texts(new.outputs) == _texts(old.outputs), old.source


def _texts(outputs):
    """The text of a cell's outputs, as a reader sees it without images."""
    return [output.get('text') or output.get('data', {}).get('text/plain')
            for output in outputs]
