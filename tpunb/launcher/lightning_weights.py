"""The trained weights back in the notebook after a Lightning ``fit``, where a process runs
several ranks as threads (TPU v2/v3: 2; simulated cores: all). ``tpunb.lightning``'s
launcher applies it, on a TPU too (it changes nothing where each rank has its process),
and ``tpunb.simulate`` gives it to Lightning's own XLA launcher."""

import copy


def trained_weights_back(upstream, launcher, trainer, results):
    """Lightning's ``_XLALauncher._collect_rank_zero_results``, reading the weights of the
    model that trained.

    Where a process runs several ranks as threads (TPU v2/v3: 2, simulated cores: all),
    Lightning's launcher deep-copies the trainer and the model in each thread, trains the
    copy, then saves the state dict of ``launcher._strategy``: the strategy of the
    original, untrained model. The notebook's model then gets its initial weights back
    after ``fit`` (seen with lightning 2.6.6; no upstream issue found as of 2026-11). The
    copy's strategy is the trainer's, so the launcher is given it here.
    """
    launcher = copy.copy(launcher)  # shared by the process's threads: never mutate it
    launcher._strategy = trainer.strategy
    return upstream(launcher, trainer, results)
