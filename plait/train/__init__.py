"""The trainer (trainer.py: one step loop for every layout), its optimizer and schedule, the data
pipeline (corpora, batches, mixtures, prepare), metrics and outputs, faults and checkpoints'
timing. docs/design.md maps its modules."""
