"""The notebooks run top to bottom, and are committed with their outputs.

Each notebook in ``notebooks/`` is executed with nbclient in a fresh kernel,
but the one that the README's command runs: that command runs it once, for
test_readme.py and this module (``readme_notebook`` in conftest.py), with
the same kernel. The kernel is this interpreter (``sys.executable``), whatever Jupyter
kernels the machine has: the test writes its own ``python3`` kernelspec into
a temporary ``JUPYTER_PATH`` entry, which Jupyter searches first. It needs
only ``ipykernel`` installed in this environment, which
``requirements/test.txt`` pins. The checkout is put on the kernel's
``PYTHONPATH``, so the notebooks use this checkout's package even where it
is not installed.
"""

from pathlib import Path

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


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A ``python3`` kernelspec that runs this interpreter, and its env."""
    env = conftest.kernel_env(tmp_path)
    for name in ('JUPYTER_PATH', 'PYTHONPATH', 'OMP_NUM_THREADS'):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv('MPLBACKEND', raising=False)
    return tmp_path


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

    def test_runs_top_to_bottom(self, path, request):
        for name in REQUIRES.get(path.name, ()):
            pytest.importorskip(name)
        committed = read(path)
        if path == ROOT / conftest.readme_notebook_command()[1]:
            # the README's command runs it (conftest.py): its outputs
            run = request.getfixturevalue('readme_notebook')
            assert run.proc.returncode == 0, run.proc.stderr[-3000:]
            notebook = read(run.executed)
        else:
            notebook = read(path)
            folder = request.getfixturevalue('kernel_env')
            client = nbclient.NotebookClient(
                notebook, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                startup_timeout=120,
                resources={'metadata': {'path': str(folder)}})
            # raises CellExecutionError, with the cell and traceback
            client.execute()

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
