"""Measuring trained models, above the trainer: the inference protocols (inference.py), the metrics (metrics.py),
the safety suite run on checkpoints (evaluate: ID, shifts, calibration, anomaly rejection; robustness: effective
robustness over training, against a testbed; the linear probe), the SFT command's before-and-after measurement
(finetune_ood.py; the fine-tuning itself is trainer/finetune_ood.py), the figures (plots.py) and the side-by-side
report (report/)."""
