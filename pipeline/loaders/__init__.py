"""Loaders: torchvision (the baseline), FFCV and DALI, each one file with no imports between them.

Each iterates (uint8 NCHW channels-last images, int64 labels) on the training device.
"""
