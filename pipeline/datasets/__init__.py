"""Datasets: the ImageFolder index every loader reads, and the generators of the embedded, CIFAR and
ImageNet-shaped trees.
"""
