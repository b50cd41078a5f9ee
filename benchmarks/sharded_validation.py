"""Wall time of a validation epoch on W=2 ranks against W=1 (gloo, CPU).

    python -m benchmarks.sharded_validation --out benchmark_results

Each rank times a validation epoch (the median of 5) of a
``DistributedGradAccMixin`` net on 4096 rows, whose batches the ranks share
(:mod:`skorch_gradacc.distributed`), one torch thread each. Saves
``sharded_validation.json``: the times, their ratio and rank 0's CPU time (its
work, whatever the load). Expected on two free cores: about 0.5x, plus gathering.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from skorch.dataset import Dataset

from benchmarks import harness
from benchmarks.workloads import mlp
from skorch_gradacc import DistributedGradAccMixin, GradAccNeuralNetClassifier

N_ROWS, N_FEATURES, BATCH_SIZE, REPEATS = 4096, 512, 64, 5


def time_validation():
    """On one rank: the median wall and CPU time of a validation epoch, s."""
    torch.manual_seed(0)
    X, y = torch.randn(N_ROWS, N_FEATURES), torch.randint(0, 10, (N_ROWS,))
    module = torch.nn.Sequential(mlp(N_FEATURES, 2048), torch.nn.Softmax(-1))
    net = type('DDPNet', (DistributedGradAccMixin, GradAccNeuralNetClassifier), {})(
        module, batch_size=BATCH_SIZE, verbose=0).initialize()
    iterator = net.get_iterator(Dataset(X, y), training=False)
    times, cpu_times = [], []
    for _ in range(REPEATS):
        net.history.new_epoch()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        net.run_single_epoch(iterator, training=False, prefix='valid',
                             step_fn=net.validation_step)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return [statistics.median(times), statistics.median(cpu_times)]


def main(argv=None):
    args = harness.parser('benchmarks.sharded_validation',
                          __doc__.splitlines()[0]).parse_args(argv)
    (one, cpu_one), (two, cpu_two) = (harness.torchrun(
        time_validation, nproc=n, malloc='default')[0] for n in (1, 2))
    result = {'rows': N_ROWS, 'batch_size': BATCH_SIZE, 'w1_seconds': one,
              'w2_seconds': two, 'ratio': two / one,
              'w1_rank0_cpu_seconds': cpu_one, 'w2_rank0_cpu_seconds': cpu_two,
              'cpu_ratio': cpu_two / cpu_one,
              'meta': harness.provenance('benchmarks.sharded_validation', sys.argv[1:])}
    print('validation epoch: W=1 {:.3f} s, W=2 {:.3f} s, ratio {:.2f}x; '
          "rank 0's CPU time ratio {:.2f}x; load average {:.1f}".format(
              one, two, two / one, cpu_two / cpu_one, os.getloadavg()[0]))
    harness.save(args.out, 'sharded_validation', result)


if __name__ == '__main__':
    main()
