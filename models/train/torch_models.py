"""Two real architectures for the training checks, as torch modules (torch needed):
a small CNN with BatchNorm and a pre-LN transformer block with a classifier head.
Used by tests/test_train_torch.py (gradients vs torch.autograd) and benchmarks/train.py
(step time vs PyTorch); `export` writes them with torch.onnx (TorchScript exporter)."""
import numpy as np
import torch


class CNN(torch.nn.Module):
    """Conv-BN-ReLU-MaxPool, Conv(stride 2)-LeakyReLU, Linear. Input [N, cin, size, size]."""

    def __init__(self, cin=3, width=8, size=8, classes=5):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, width, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(width * (size // 4) ** 2, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.nn.functional.leaky_relu(self.conv2(x), 0.1)
        return self.fc(torch.flatten(x, 1))


class Block(torch.nn.Module):
    """Pre-LN transformer block (MatMul attention, Softmax, GELU) + mean-pool classifier.
    Input [N, T, d]."""

    def __init__(self, d=16, heads=2, classes=3):
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(n, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.h) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(n, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(1))


def export(module: torch.nn.Module, x: np.ndarray, path: str) -> str:
    """ONNX export (opset 17, dynamic batch axis) with parameter names kept as initializer
    names (no constant folding, so Linear weights are not pre-transposed copies)."""
    module.eval()
    torch.onnx.export(module, (torch.from_numpy(x),), path, input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}}, opset_version=17, dynamo=False,
                      do_constant_folding=False)
    return path
