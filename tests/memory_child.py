"""A fit in a process of its own, measured as a container measures it.

``run(config)`` starts ``python memory_child.py CONFIG`` in a new cgroup
(v1 or v2 memory controller; the tests that need one skip without it) and
returns what the child printed: whether the fit trained or the error it
raised, the plan, and the cgroup's peak above its usage when ``fit``
started (``'peak'``). With ``config['limit']``, the child limits its cgroup
to that usage plus the budget first (plus ``config['leave']`` bytes, if
given): over it, the kernel kills the child (``'killed'``). Before the
fit, the child trains once on a few rows, as a process that has trained
before (the first optimizer imports torch's compiler, tens of MiB).

The workloads (``config['workload']``):

* ``mlp``: an MLP 32-1024-1024-10 (1.09 M parameters), 512 rows, SGD with
  momentum, float32;
* ``large_mlp``: 64-1024-1024-10 on 16,384 rows in one batch;
* ``adam``: wide layers (2048) whose Adam state dominates a step;
* ``classes``: 64-256-8192 (8,192 classes), 1,024 rows, SGD with momentum:
  its matrix products' buffers (MKL's) are large beside its activations.

``config['micro_batch_size']`` fits that fixed size instead of ``'auto'``.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

# the memory controller of cgroup v1 or v2, where this process may make one
V1, V2 = Path('/sys/fs/cgroup/memory'), Path('/sys/fs/cgroup')


def _controller():
    if os.geteuid() != 0:
        return None
    if (V1 / 'memory.max_usage_in_bytes').exists():
        return 'v1'
    if 'memory' in (V2 / 'cgroup.controllers').read_text().split() \
            if (V2 / 'cgroup.controllers').exists() else False:
        return 'v2'
    return None


CONTROLLER = _controller()
FILES = {'v1': ('memory.usage_in_bytes', 'memory.max_usage_in_bytes',
                'memory.limit_in_bytes'),
         'v2': ('memory.current', 'memory.peak', 'memory.max')}


def run(config, timeout=300):
    """Run the child of ``config`` in a new cgroup; return its result."""
    folder = (V1 if CONTROLLER == 'v1' else V2) / (
        'skorch-gradacc-test-' + uuid.uuid4().hex[:12])
    folder.mkdir()
    try:
        def enter():
            (folder / 'cgroup.procs').write_text(str(os.getpid()))

        proc = subprocess.run(
            [sys.executable, __file__, json.dumps(dict(config, cgroup=str(
                folder)))], preexec_fn=enter, capture_output=True, text=True,
            timeout=timeout, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                sys.path)))
    finally:
        folder.rmdir()
    if proc.returncode in (-9, 137):
        return {'killed': True, 'stderr': proc.stderr[-2000:]}
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return dict(json.loads(proc.stdout.splitlines()[-1]), killed=False)


def make_net(workload, **params):
    """The net, X and y of a workload; ``params`` set on the net."""
    import numpy as np
    import torch

    from skorch_gradacc import GradAccNeuralNetClassifier

    momentum = {'optimizer__momentum': 0.9}
    inputs, widths, rows, optimizer, extra = {
        'mlp': (32, (1024, 1024, 10), 512, torch.optim.SGD, momentum),
        'large_mlp': (64, (1024, 1024, 10), 16384, torch.optim.SGD, momentum),
        'adam': (64, (2048, 2048, 10), 1024, torch.optim.Adam, {}),
        'classes': (64, (256, 8192), 1024, torch.optim.SGD, momentum),
    }[workload]
    rng = np.random.RandomState(0)
    X = rng.randn(rows, inputs).astype(np.float32)
    y = rng.randint(0, widths[-1], rows)
    layers = []
    for width in widths:
        layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
        inputs = width
    module = torch.nn.Sequential(*layers[:-1])
    net = GradAccNeuralNetClassifier(
        module, criterion=torch.nn.CrossEntropyLoss, optimizer=optimizer,
        lr=0.01, batch_size=rows, max_epochs=2, train_split=None, verbose=0,
        **dict(extra, **params))
    return net, X, y


def main(config):
    import torch

    cgroup = Path(config.pop('cgroup'))
    usage, peak, limit = (cgroup / name for name in FILES[CONTROLLER])
    warm, X, y = make_net(config['workload'], micro_batch_size='auto')
    warm.fit(X[:8], y[:8])
    del warm
    torch.manual_seed(0)
    size = config.get('micro_batch_size', 'auto')
    budget = {'memory_budget': config['budget']} if size == 'auto' else {}
    net, X, y = make_net(config['workload'], micro_batch_size=size, **budget)
    start = int(usage.read_text())
    peak.write_text('0')  # the peak from here (v1; v2 since Linux 6.12)
    if config.get('limit') or config.get('leave'):
        limit.write_text(str(start + (config.get('leave') or config['budget'])))
    error = None
    try:
        net.fit(X, y)
    except ValueError as exc:
        error = str(exc)
    measured = int(peak.read_text()) - start
    plan = getattr(net, 'memory_plan_', None)
    print(json.dumps({'error': error, 'peak': measured, 'plan': plan,
                      'trained': error is None}))


if __name__ == '__main__':
    main(json.loads(sys.argv[1]))
