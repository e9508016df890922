"""tpunb: multi-core PyTorch/XLA training from a notebook that simply works.

    import tpunb
    tpunb.env()                      # what am I running on, and what will go wrong?
    tpunb.simulate(cores=8)          # no TPU here: 8 TPU cores simulated on the CPU
    results = tpunb.launch(train, config)   # train(rank, config) on every core

Importing tpunb imports neither torch_xla nor any plotting library and leaves
``os.environ`` alone; they are used only by the calls that need them.
"""

__version__ = "0.2.0"

from tpunb import hardware, memory, plots  # light: they import heavy libraries when called
from tpunb.batches import (
    batch_report,
    global_batch_size,
    per_core_batch_size,
    scale_learning_rate,
)
from tpunb.buckets import BucketCollate, choose_buckets
from tpunb.environment import Environment, env
from tpunb.errors import RankError, TpunbError, TpunbWarning
from tpunb.graph_limit import limit_graphs
from tpunb.launcher import LaunchResults, launch
from tpunb.metrics import log
from tpunb.sampling import shard
from tpunb.simulation import simulate
from tpunb.sweep import sweep_batch_sizes
from tpunb.watch.compile_watch import CompileSummary
from tpunb.watch.history import History

__all__ = [
    "BucketCollate",
    "CompileSummary",
    "Environment",
    "History",
    "LaunchResults",
    "RankError",
    "TpunbError",
    "TpunbWarning",
    "batch_report",
    "choose_buckets",
    "env",
    "global_batch_size",
    "hardware",
    "launch",
    "limit_graphs",
    "log",
    "memory",
    "per_core_batch_size",
    "plots",
    "scale_learning_rate",
    "shard",
    "simulate",
    "sweep_batch_sizes",
]
