"""Shared fixtures: graph mode once, a tiny float64 config."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from capsnet import model  # noqa: E402

tf.compat.v1.disable_eager_execution()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 12x12 images -> conv1 3x3 -> 10x10x4 -> primary 3x3/2 -> 4x4x2 = 32 capsules.
TINY = dict(image_size=12, conv1_channels=4, conv1_kernel=3, primary_types=2,
            primary_dim=4, primary_kernel=3, primary_stride=2, num_classes=3,
            digit_dim=4, decoder_units=(8,), dtype="float64")


@pytest.fixture
def tiny_cfg():
  return model.ModelConfig(**TINY)
