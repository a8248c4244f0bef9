"""The model zoo: models people bring, each at two sizes. "tiny" is for the CPU tests (the
interp backend checks outputs and gradients against eager); "real" is for benchmarks/
bench_models.py on a GPU (torchvision's ResNet-50 and MobileNetV3, timm's ViT and Hugging
Face's GPT-2, BERT and Mistral configurations, random weights: nothing is downloaded).

The CPU test machine cannot load torchvision's or timm's wheels, so their tiny sizes are
equivalent modules written here (the same layers: BatchNorm, in-place ReLU, hardswish, SE
blocks, patch embedding); transformers works on the CPU and is used at both sizes. Dropout is
off in the transformer configurations, so a training step is compared with eager's exactly."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class ZooModel:
    name: str
    make: Callable        # make(size) -> nn.Module, in train mode
    call: Callable        # call(size, generator, device) -> (args, kwargs) of one forward
    loss: Callable        # loss(output, args, kwargs) -> a scalar to train on
    output: Callable      # output(output) -> the tensor inference is compared on


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


def _mean_square(out, args, kwargs):
    return _first(out).float().pow(2).mean()


def _cross_entropy(out, args, kwargs):
    logits = _first(out).float()
    target = torch.arange(logits.shape[0], device=logits.device) % logits.shape[-1]
    return F.cross_entropy(logits, target)


def _hf_loss(out, args, kwargs):
    return out.loss if getattr(out, "loss", None) is not None else _mean_square(out, args, kwargs)


# ------------------------------------------------------------------------------------ vision

class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck: 1x1, 3x3, 1x1 convolutions, BatchNorm, in-place ReLU,
    a strided projection on the skip where the shape changes."""
    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = Bottleneck(8, 4)
        self.layer2 = Bottleneck(16, 8, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1 = nn.Conv2d(c, c // r, 1)
        self.fc2 = nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: expand (1x1), depthwise 3x3, squeeze-excite, project (1x1), hardswish."""

    def __init__(self, cin, exp, cout, stride):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(exp, exp, 3, stride, 1, groups=exp, bias=False), nn.BatchNorm2d(exp),
                                nn.Hardswish())
        self.se = SqueezeExcite(exp)
        self.project = nn.Sequential(nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.dw(self.expand(x))))
        return x + y if self.residual else y


class TinyMobileNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(8, 16, 8, 1), InvertedResidual(8, 24, 16, 2))
        self.head = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Linear(32, classes))

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ViTBlock(nn.Module):
    """timm's ViT block: pre-norm attention (one qkv Linear, scaled dot product) and a GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, classes=10, dim=32, depth=2, heads=2, patch=4, image=16):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class MnistCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


class UNet(nn.Module):
    """A two-level U-Net: conv-BN-ReLU pairs, max-pool down, transposed-conv up, skip concat."""

    def __init__(self, cin=3, base=8, cout=2):
        super().__init__()

        def pair(a, b):
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(inplace=True),
                                 nn.Conv2d(b, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU(inplace=True))
        self.down1, self.down2 = pair(cin, base), pair(base, 2 * base)
        self.mid = pair(2 * base, 4 * base)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * base, 2 * base, 2, 2), pair(4 * base, 2 * base)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * base, base, 2, 2), pair(2 * base, base)
        self.out = nn.Conv2d(base, cout, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.out(u1)


def _torchvision(name):
    import torchvision
    return getattr(torchvision.models, name)(weights=None)


def _timm(name):
    import timm
    return timm.create_model(name, pretrained=False)


def _images(n_tiny, n_real, hw_tiny=16, hw_real=224, channels=3):
    def call(size, gen, device):
        n, hw = (n_tiny, hw_tiny) if size == "tiny" else (n_real, hw_real)
        return (torch.randn(n, channels, hw, hw, generator=gen).to(device),), {}
    return call


# ------------------------------------------------------------------------------------ transformers

def _hf_config(kind, size):
    """Dropout is off at both sizes: a training step is then compared with eager's exactly (the
    kernels are the same with it on: dropout runs as torch's own op)."""
    import transformers
    if kind == "gpt2":
        off = dict(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        return (transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, **off)
                if size == "tiny" else transformers.GPT2Config(**off))
    if kind == "bert":
        off = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return (transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                        intermediate_size=128, vocab_size=128, max_position_embeddings=64, **off)
                if size == "tiny" else transformers.BertConfig(**off))
    if kind == "mistral":
        return (transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                                           max_position_embeddings=64)
                if size == "tiny" else
                transformers.MistralConfig(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
                                           num_key_value_heads=4, intermediate_size=3584, vocab_size=32000))
    raise ValueError(kind)


def _hf_model(kind):
    def make(size):
        import transformers
        cfg = _hf_config(kind, size)
        cls = {"gpt2": transformers.GPT2LMHeadModel, "bert": transformers.BertForSequenceClassification,
               "mistral": transformers.MistralForCausalLM}[kind]
        return cls(cfg).train()
    return make


def _tokens(kind):
    def call(size, gen, device):
        vocab = 128 if size == "tiny" else _hf_config(kind, size).vocab_size
        b, t = (2, 16) if size == "tiny" else ((8, 1024) if kind == "gpt2" else (8, 512))
        ids = torch.randint(0, vocab, (b, t), generator=gen).to(device)
        if kind == "bert":   # a padding mask: the last quarter of the second sequence is padding
            mask = torch.ones(b, t, dtype=torch.long)
            mask[1, 3 * t // 4:] = 0
            return (ids,), {"attention_mask": mask.to(device), "labels": (torch.arange(b) % 2).to(device)}
        return (ids,), {"labels": ids}
    return call


def _vision(make_tiny, real):
    def make(size):
        return (make_tiny() if size == "tiny" else real()).train()
    return make


ZOO = [
    ZooModel("gpt2", _hf_model("gpt2"), _tokens("gpt2"), _hf_loss, _first),
    ZooModel("bert", _hf_model("bert"), _tokens("bert"), _hf_loss, _first),
    ZooModel("mistral", _hf_model("mistral"), _tokens("mistral"), _hf_loss, _first),
    ZooModel("resnet50", _vision(TinyResNet, lambda: _torchvision("resnet50")), _images(4, 64), _cross_entropy,
             _first),
    ZooModel("mobilenet_v3", _vision(TinyMobileNet, lambda: _torchvision("mobilenet_v3_small")), _images(4, 64),
             _cross_entropy, _first),
    ZooModel("vit", _vision(TinyViT, lambda: _timm("vit_small_patch16_224")), _images(4, 64), _cross_entropy,
             _first),
    ZooModel("mnist_mlp", _vision(MLP, MLP), _images(64, 64, 28, 28, channels=1), _cross_entropy, _first),
    ZooModel("mnist_cnn", _vision(MnistCNN, MnistCNN), _images(16, 64, 28, 28, channels=1), _cross_entropy,
             _first),
    ZooModel("unet", _vision(UNet, lambda: UNet(base=32)), _images(2, 16, 16, 128), _mean_square, _first),
]
BY_NAME = {m.name: m for m in ZOO}
