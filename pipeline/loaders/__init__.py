"""Loaders: torchvision (the baseline), FFCV, DALI, memory (small datasets held on the device) and nvJPEG, each one
file with no imports between them; registry.py names them.

Each iterates (uint8 NCHW channels-last images, int64 labels) on the training device.
"""
