"""A run's model and records, which plan and train both read: the whole-run arithmetic
(phases), the predictions plan saved (predicted) and the held-out curves runs recorded (accuracy)."""
