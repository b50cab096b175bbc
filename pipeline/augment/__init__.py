"""Batch and sample augmentations: AugMix, PixMix, random erasing, mixup/cutmix, label noise."""
