"""Small models for the integrated observation: a training step (forward, backward, Adam) that
consumes each batch, so the bench and the profiler see the loader with a model waiting on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["TrainStep", "make_train_step"]


class SmallCNN(nn.Module):
    """The seed study's kind of CNN: two conv-relu-pool blocks and two linear layers.

    Args:
        in_channels: image channels.
        num_classes: outputs.
        width: channels of the first conv (the second has twice as many). 32 is the study's size;
            the bench uses less on a CPU, where the model would otherwise be all there is to see.
        image_size: input height and width (a multiple of 4).
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 32, image_size: int = 28
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * side * side, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class StridedCNN(nn.Module):
    """A small CNN for 224x224 inputs: strided convs down to a pooled vector."""

    def __init__(self, in_channels: int = 3, num_classes: int = 1000, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, stride=4, padding=3),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TokenClassifier(nn.Module):
    """Embedding, masked mean over real tokens, linear head."""

    def __init__(self, vocab: int = 32_000, width: int = 32, num_classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 2 * width, padding_idx=0)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.to(torch.float32).unsqueeze(-1)
        pooled = (self.embed(tokens) * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.head(pooled)


class FieldsMLP(nn.Module):
    """Concatenates every float field and feeds an MLP."""

    def __init__(self, in_features: int, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_features, 4 * width), nn.ReLU(), nn.Linear(4 * width, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


FIELDS_FEATURES = 12 * 8 + 4  # ManyFields' defaults: twelve float32[8] tensors and four floats
TABULAR_FEATURES = 64  # the arrays preset's rows


def _field_features(batch: Mapping[str, Any]) -> torch.Tensor:
    parts = []
    for key in sorted(batch):
        value = batch[key]
        if key.startswith("f") and isinstance(value, torch.Tensor):
            parts.append(value.float())
        elif key.startswith("s") and isinstance(value, torch.Tensor):
            parts.append(value.float().unsqueeze(1))
    return torch.cat(parts, dim=1)


class TrainStep:
    """One training step on a batch dict: zero_grad, forward, loss, backward, Adam step.

    Args:
        name: ``"fashion_cnn"``, ``"imagenet_cnn"``, ``"token_classifier"``, ``"fields_mlp"`` or
            ``"tabular_mlp"``.
        device: where the model lives (the batch must be there too).
        width: the model's width (see :class:`SmallCNN`).
        seed: initial weights.
    """

    def __init__(self, name: str, device: torch.device | str, width: int = 32, seed: int = 0) -> None:
        self.name = name
        self.device = torch.device(device)
        torch.manual_seed(seed)
        if name == "fashion_cnn":
            model: nn.Module = SmallCNN(1, 10, width)
        elif name == "imagenet_cnn":
            model = StridedCNN(3, 1000, width)
        elif name == "token_classifier":
            model = TokenClassifier(width=width)
        elif name == "fields_mlp":
            model = FieldsMLP(FIELDS_FEATURES, width)
        elif name == "tabular_mlp":
            model = FieldsMLP(TABULAR_FEATURES, width)
        else:
            raise ValueError(
                f"unknown model {name!r}: fashion_cnn, imagenet_cnn, token_classifier, fields_mlp, "
                "tabular_mlp"
            )
        self.width = width
        self.model = model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters())
        self.loss_fn = nn.CrossEntropyLoss()

    def describe(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        return f"{self.name} (width {self.width}, {params:,} parameters, Adam, {self.device.type})"

    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if self.name == "token_classifier":
            logits = self.model(batch["tokens"], batch["tokens_mask"])
        elif self.name == "fields_mlp":
            logits = self.model(_field_features(batch))
        elif self.name == "tabular_mlp":
            logits = self.model(batch["x"])
        else:
            logits = self.model(batch["image"])
        loss = self.loss_fn(logits, batch["target"])
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def make_train_step(name: str, device: torch.device | str, width: int = 32, seed: int = 0) -> TrainStep:
    """A :class:`TrainStep` for a preset's model name."""
    return TrainStep(name, device, width, seed)
