"""torch modules for the training-step benchmarks (benchmarks/train_cpu.py, train_heldout.py),
their ONNX export and their fixed batches. torch is imported inside the functions, so that
importing this module needs numpy only.

- `resnet(...)`: torchvision's ResNet layout (attribute names conv1/bn1/layer1..4/fc, stride on
  the 3x3 conv of a bottleneck, 1x1 conv + BN shortcut, torchvision's Kaiming init): ResNet-18 /
  34 (BasicBlock), ResNet-50 (Bottleneck), ResNeXt (Bottleneck with groups / width_per_group).
- `encoder_stack(...)`: benchmarks/train.py's EncoderStack (BERT's post-LN layer on embeddings).
- `token_tagger(...)`: nn.Embedding + nn.TransformerEncoder (batch_first, pre-LN, GELU) + a
  per-token classifier head: the model takes int64 token ids and gives [N, T, classes].
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _blocks():
    """(BasicBlock, Bottleneck) classes, torchvision's layout."""
    import torch
    nn, F = torch.nn, torch.nn.functional

    def shortcut(cin, cout, stride):
        if stride == 1 and cin == cout:
            return None
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    class BasicBlock(nn.Module):
        expansion = 1

        def __init__(self, cin, planes, stride=1, groups=1, base_width=64):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False), nn.BatchNorm2d(planes)
            self.downsample = shortcut(cin, planes, stride)

        def forward(self, x):
            y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
            return F.relu(y + (x if self.downsample is None else self.downsample(x)))

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, cin, planes, stride=1, groups=1, base_width=64):
            super().__init__()
            width = int(planes * base_width / 64) * groups
            cout = planes * self.expansion
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.downsample = shortcut(cin, cout, stride)

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = F.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return F.relu(y + (x if self.downsample is None else self.downsample(x)))

    return BasicBlock, Bottleneck


def resnet(block: str, layers, width: int = 64, classes: int = 1000, groups: int = 1, width_per_group: int = 64):
    """A torchvision-layout ResNet. block "basic" (ResNet-18: layers (2, 2, 2, 2); ResNet-34:
    (3, 4, 6, 3)) or "bottleneck" (ResNet-50: (3, 4, 6, 3); ResNeXt-50 32x4d: groups 32,
    width_per_group 4); `width` 64 is the real network (smaller values for toy sizes)."""
    import torch
    nn, F = torch.nn, torch.nn.functional
    Basic, Bottleneck = _blocks()
    cls = Basic if block == "basic" else Bottleneck

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin, stages = width, []
            for i, n in enumerate(layers):
                planes = width * 2 ** i
                blocks = []
                for j in range(n):
                    blocks.append(cls(cin, planes, 2 if (j == 0 and i > 0) else 1, groups, width_per_group))
                    cin = planes * cls.expansion
                stages.append(nn.Sequential(*blocks))
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.fc = nn.Linear(cin, classes)
            for m in self.modules():  # torchvision's init
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def forward(self, x):
            x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    return ResNet()


def encoder_stack(d: int, heads: int, layers: int, classes: int = 2):
    """benchmarks/train.py's EncoderStack: `layers` post-LN encoder layers (FFN 4d, GELU) on
    [N, T, d] embeddings, mean-pooled classifier head."""
    sys.path.insert(0, HERE)
    import train as train_bench  # benchmarks/train.py
    return train_bench._gpu_sized_modules()["EncoderStack"](d=d, heads=heads, layers=layers, classes=classes)


def token_tagger(vocab: int, d: int, heads: int, layers: int, ffn: int, classes: int):
    """nn.Embedding + nn.TransformerEncoder (batch_first, pre-LN, GELU, no dropout, so that both
    engines compute the same function) + a Linear head on every token: int64 [N, T] -> [N, T, classes]."""
    import torch
    nn = torch.nn

    class TokenTagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, activation="gelu", batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, classes)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    return TokenTagger()


def make_batch(spec: dict, seed: int = 0) -> dict:
    """The fixed batch of a case: {"x": ..., "labels": ...}. spec: x (shape), classes, and
    optionally vocab (then x holds int64 token ids and labels one class per token)."""
    r = np.random.default_rng(seed)
    shape = tuple(spec["x"])
    if spec.get("vocab"):
        return {"x": r.integers(0, spec["vocab"], shape).astype(np.int64),
                "labels": r.integers(0, spec["classes"], shape).astype(np.int64)}
    return {"x": r.standard_normal(shape).astype(np.float32),
            "labels": r.integers(0, spec["classes"], shape[0]).astype(np.int64)}


def export(module, batch: dict, path: str) -> str:
    """ONNX export as the repo's tests do it (opset 17, TorchScript exporter, dynamic batch
    axis "N", parameter names kept; tests/fixtures/torch_models.export), for float or token inputs."""
    sys.path.insert(0, REPO)
    from tests.fixtures import torch_models
    return torch_models.export(module, batch["x"], path)
