"""The safety evaluation suite run on trained checkpoints: evaluation (ID, shifts, calibration,
anomaly rejection), effective robustness over training, the linear probe, sharpness-aware OOD
fine-tuning (SFT), and the figures these commands and the report draw (plots.py)."""
