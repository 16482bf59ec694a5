"""What the Trainer strategy ([OneBitStrategy][lightning_onebit.OneBitStrategy]) and the Fabric
strategy ([OneBitFabricStrategy][lightning_onebit.OneBitFabricStrategy]) share: one implementation of each piece, which
the two strategies wire into Lightning's ``DDPStrategy`` of their own kind. Internal: the public
names are re-exported from ``lightning_onebit``.

Nothing here imports ``lightning.pytorch``, and messages name the strategy class the user built
(passed in), never one of the two by itself, and what to do in the user's front end
(``front_end``: the Trainer's or Fabric's API).

* ``strategy_base``: ``OneBitStrategyBase``, what both strategies do the same way (first in
  their bases), and ``takes_options``, their signatures and option docs from ``options``.
* ``options``: ``StrategyOptions``, the one declaration of both strategies' options (types,
  defaults, docs) and their checks, and ``ALGORITHMS``.
* ``optimizer``: ``OptimizerBuilder``, the 1-bit optimizer from the user's
  (a torch Adam/AdamW converted, one of ours used as built, or a DeepSpeed config's), the
  two-level exchange and the overlap with backward.
* ``convert``: the Adam/AdamW conversion itself, and the LR schedulers re-pointed.
* ``phase_switch``: when compression starts, identically on every rank; the step counters.
* ``hook``: the DDP communication hook (averages on warmup steps, nothing on compression steps),
  and the DDP wrapper with it registered.
* ``scaler``: the ``16-mixed`` loss scaler whose overflow check is combined across ranks.
* ``rank_files``: the per-rank checkpoint files beside a checkpoint; ``RankCheckpoint``
  writes, reads and restores them for a strategy.
* ``deepspeed``: DeepSpeed JSON configs read into options.
* ``front_end``: how the Trainer and Fabric each do what a message asks (``TRAINER``, ``FABRIC``).
* ``lifecycle``: launch checks, the default process group's life, teardown.
* ``registry``: the registered strategy names and the near-miss ones.
* ``checks``, ``errors``: cross-rank model checks; one traceback instead of one per rank.
"""
