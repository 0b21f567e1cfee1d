"""What Ray's Horovod examples take from ``torchvision`` (``datasets.MNIST`` and the
``transforms`` they apply), made here: torchvision does not import beside this machine's
CPU torch, and the tests download nothing. Ray's examples run with their
``from torchvision import datasets, transforms`` pointed at this module, their one change
besides the trainer's import (test_ray_examples.py).

``MNIST`` holds ``SIZE`` synthetic 28x28 digits: each label lights its own band of rows,
so a model can learn them; the same images for every rank and every call."""

from __future__ import annotations

import types

import numpy as np
import torch

SIZE = 256


class _MNIST(torch.utils.data.Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        del root, download  # nothing is read or fetched
        generator = np.random.default_rng(0 if train else 1)
        self.targets = generator.integers(0, 10, SIZE)
        images = generator.integers(0, 64, (SIZE, 28, 28)).astype(np.uint8)
        for image, label in zip(images, self.targets, strict=True):
            image[2 * label : 2 * label + 4] = 255
        self.data = images
        self.transform = transform

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index):
        image = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


class _Compose:
    def __init__(self, steps):
        self.steps = list(steps)

    def __call__(self, image):
        for step in self.steps:
            image = step(image)
        return image


class _ToTensor:
    """An HxW uint8 image as a 1xHxW float tensor in [0, 1], as torchvision's."""

    def __call__(self, image):
        return torch.from_numpy(image).float().div(255).unsqueeze(0)


class _Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, tensor):
        return (tensor - self.mean) / self.std


datasets = types.SimpleNamespace(MNIST=_MNIST)
transforms = types.SimpleNamespace(Compose=_Compose, ToTensor=_ToTensor, Normalize=_Normalize)
