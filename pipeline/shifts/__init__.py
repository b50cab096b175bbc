"""Distribution shifts: the corruptions (CIFAR-C, ImageNet-C-bar) and the evaluation sets built from them."""
