"""The training schedule of the authors' code (Sarasra/models,
research/capsules), which the paper's Section 4 leaves out: Adam at 1e-3,
decayed by 0.96 every 2000 steps, batches of 128. train.py's flag defaults
and the study's run names read it here."""
BATCH_SIZE = 128
LEARNING_RATE = 1e-3
DECAY_RATE = 0.96
DECAY_STEPS = 2000
