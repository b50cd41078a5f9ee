"""The package's import graph: no circle, and FSDP2 only when it is used."""

import subprocess
import sys

import pytest
from test_structure import find_circle, import_graph


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    # the DDP mixin imports its engine, never FSDP2 (that is loaded lazily,
    # by the package's __getattr__)
    assert graph['skorch_gradacc.distributed'] == {
        'skorch_gradacc.batching', 'skorch_gradacc.engine'}
    assert find_circle(graph) is None


@pytest.mark.slow  # a fresh interpreter imports torch
def test_importing_the_package_leaves_fsdp_alone():
    code = (
        "import sys, skorch_gradacc\n"
        "assert not [m for m in sys.modules if 'fsdp' in m], 'imported'\n"
        "from skorch_gradacc.fully_sharded import FullyShardedGradAccMixin\n"
        "assert skorch_gradacc.FullyShardedGradAccMixin is "
        "FullyShardedGradAccMixin\n"
        "import skorch_gradacc.distributed as d\n"
        "assert not hasattr(d, 'FullyShardedGradAccMixin')  # one home\n"
        "assert 'torch.distributed.fsdp' in sys.modules\n")
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # a fresh interpreter imports torch
@pytest.mark.parametrize('version, fsdp2', [('2.3.0', False), ('2.8.0', True)])
def test_star_import_at_every_torch_version(version, fsdp2):
    # below torch 2.8 (FSDP2), the star import leaves FullyShardedGradAccMixin
    # out instead of failing; this torch is told its version is the one given
    code = (
        "import torch\n"
        "torch.__version__ = {!r}\n"
        "from skorch_gradacc import *\n"
        "assert ('FullyShardedGradAccMixin' in dir()) == {!r}\n"
        "assert GradAccNeuralNetClassifier and BatchNormWarning\n").format(
            version, fsdp2)
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
