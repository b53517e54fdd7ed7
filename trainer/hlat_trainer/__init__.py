"""hlat_trainer: the trainer that runs in every worker pod (and locally).

Modules, one concept each: model (the decoder), precision and optim (bf16 with stochastic
rounding), data (the online packing loader), schedule, monitor (gradient spikes), checkpoint,
metrics, report (per-step output), train (the loop), cli.
"""
