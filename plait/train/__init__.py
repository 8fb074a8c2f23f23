"""The trainer (trainer.py: one step loop for every layout), metrics and outputs (report, compare,
tracing), faults and checkpoints' timing. docs/design.md maps its modules."""
