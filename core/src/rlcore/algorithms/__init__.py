"""Built-in algorithms, registered by :mod:`rlcore.builtin` under the ``algorithm`` section; they import config, interfaces and data.

========== ======================================= ======================================
name       module                                  what differs
========== ======================================= ======================================
grpo       :mod:`rlcore.algorithms.grpo`           group-normalized advantages, clipped ratio
dapo       :mod:`rlcore.algorithms.dapo`           + dynamic sampling, overlong shaping/filter
gspo       :mod:`rlcore.algorithms.gspo`           sequence-level importance ratio
dr_grpo    :mod:`rlcore.algorithms.dr_grpo`        no std, constant length normalizer
rloo       :mod:`rlcore.algorithms.rloo`           leave-one-out baseline
reinforce_pp :mod:`rlcore.algorithms.reinforce_pp` batch-level advantage normalization
sft        :mod:`rlcore.algorithms.sft`            masked negative log-likelihood
cispo      :mod:`rlcore.algorithms.cispo`          clipped detached IS weight, no token cut
ppo        :mod:`rlcore.algorithms.ppo`            learned critic, GAE per token, clipped value loss
========== ======================================= ======================================

Importing this package imports no torch; the algorithm modules do.
"""
