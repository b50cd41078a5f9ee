"""What the torchrun workers share: the process group, scenarios, teardown.

A worker's command line is ``OUT_DIR SCENARIOS [ARGS]``, where SCENARIOS is a
comma-separated list: :func:`run_scenarios` runs them one after another in
one process group, so that one launch of torchrun (seconds of start-up)
serves many tests. Each scenario starts from the same seed, with a new net,
and writes to its own folder OUT_DIR/SCENARIO; it ends with each rank's
``rank{r}.pt`` (:func:`save_rank`), which the tests take as its mark of
completion. A scenario that raises writes its traceback to
OUT_DIR/SCENARIO/error-rank{r}.txt and ends the rank, as it would end a
user's script: torchrun then stops the other ranks, which could otherwise
wait forever in a collective, and the scenarios after it leave no output.
"""

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def scenario_dir(out_dir, scenario):
    """The folder of one scenario's outputs, created if need be."""
    path = Path(out_dir) / scenario
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_rank(obj, folder, save=torch.save):
    """Save this rank's results as ``folder/rank{r}.pt``, whole or not at
    all: the file is written under another name and renamed."""
    path = Path(folder) / 'rank{}.pt'.format(int(os.environ['RANK']))
    tmp = path.with_name(path.name + '.part')
    save(obj, tmp)
    os.replace(tmp, path)


def run_scenarios(out_dir, scenarios, run_one, backend='gloo',
                  init_group=True):
    """Run each of the comma-separated ``scenarios`` with
    ``run_one(scenario, folder)``, then tear down (:func:`finish`).

    Before each scenario every rank seeds torch with 0 (the same initial
    weights on every rank). With ``init_group=False`` the first scenario
    sets up the process group itself (Accelerate does).
    """
    if init_group:
        dist.init_process_group(backend)
    for scenario in scenarios.split(','):
        folder = scenario_dir(out_dir, scenario)
        torch.manual_seed(0)
        try:
            run_one(scenario, folder)
        except BaseException:
            (folder / 'error-rank{}.txt'.format(os.environ.get('RANK'))
             ).write_text(traceback.format_exc())
            raise  # as a user's script would: torchrun stops the other ranks
    finish()


def finish():
    """End the rank once every rank is done."""
    dist.barrier()  # no rank tears down while another still talks
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip Python's teardown, where gloo can abort (docs: scaling out)
