"""The in-project ResNet-50 v1.5 matches torchvision's resnet50 in size and naming."""
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.resnet import resnet50  # noqa: E402


def test_parameter_count_and_tensors():
    model = resnet50()
    params = list(model.parameters())
    assert len(params) == 161
    assert sum(p.numel() for p in params) == 25_557_032


def test_torchvision_names():
    names = [n for n, _ in resnet50().named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer1.0.conv1.weight" in names
    assert "layer1.0.downsample.0.weight" in names
    assert "layer4.2.bn3.bias" in names
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert "layer4.2.bn3.running_var" in resnet50().state_dict()


def test_stride_on_3x3_conv_v1_5():
    block = resnet50().layer2[0]
    assert block.conv1.stride == (1, 1)
    assert block.conv2.stride == (2, 2)


def test_forward_shape_and_channels_last():
    torch.manual_seed(0)
    model = resnet50(num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (1, 10)
        model_cl = model.to(memory_format=torch.channels_last)
        out_cl = model_cl(x.to(memory_format=torch.channels_last))
    assert out_cl.shape == (1, 10)
    assert torch.allclose(out, out_cl, rtol=1e-3, atol=1e-4)
