"""Small graphs built from the blocks of real Keras architectures, written the way ``keras.applications`` writes them.

Each builder returns an untrained functional model on 16x16 RGB images (or a small vector/sequence input) with
fixed layer names, so the tests can say exactly where masks must go.
"""

from __future__ import annotations

import keras
from keras import layers, ops

CLASSES = 3


def hard_sigmoid(x: keras.KerasTensor) -> keras.KerasTensor:
    """MobileNetV3's hard sigmoid, as raw operations on Keras tensors (an Add and a Multiply)."""
    return layers.ReLU(6.0)(x + 3.0) * (1.0 / 6.0)


def hard_swish(x: keras.KerasTensor) -> keras.KerasTensor:
    return x * (ops.relu6(x + 3.0) / 6.0)


def mobilenet_v3_like() -> keras.Model:
    """Stem, one inverted residual (expand, depthwise, squeeze-excitation with hard sigmoid, project), head."""
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="conv")(inputs)
    x = hard_swish(layers.BatchNormalization(name="conv_bn")(x))
    shortcut = x
    x = layers.Conv2D(16, 1, use_bias=False, name="expanded_conv_expand")(x)
    x = hard_swish(layers.BatchNormalization(name="expanded_conv_expand_bn")(x))
    x = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="expanded_conv_depthwise")(x)
    x = layers.ReLU(name="expanded_conv_depthwise_relu")(layers.BatchNormalization(name="expanded_conv_dw_bn")(x))
    squeezed = layers.GlobalAveragePooling2D(keepdims=True, name="expanded_conv_squeeze_excite_avg_pool")(x)
    squeezed = layers.Conv2D(4, 1, name="expanded_conv_squeeze_excite_conv")(squeezed)
    squeezed = layers.ReLU(name="expanded_conv_squeeze_excite_relu")(squeezed)
    squeezed = hard_sigmoid(layers.Conv2D(16, 1, name="expanded_conv_squeeze_excite_conv_1")(squeezed))
    x = layers.Multiply(name="expanded_conv_squeeze_excite_mul")([x, squeezed])
    x = layers.Conv2D(8, 1, use_bias=False, name="expanded_conv_project")(x)
    x = layers.BatchNormalization(name="expanded_conv_project_bn")(x)
    x = layers.Add(name="expanded_conv_add")([shortcut, x])
    x = layers.GlobalAveragePooling2D(keepdims=True)(hard_swish(layers.Conv2D(24, 1, name="conv_1")(x)))
    x = layers.Dropout(0.2, name="dropout")(x)
    x = layers.Flatten()(layers.Conv2D(CLASSES, 1, name="logits")(x))
    return keras.Model(inputs, layers.Activation("softmax", name="predictions")(x), name="mobilenet_v3_like")


def efficientnet_like() -> keras.Model:
    """Stem, two MBConv blocks with squeeze-excitation and swish (the second with stochastic depth), head."""
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = layers.Activation("swish", name="stem_activation")(layers.BatchNormalization(name="stem_bn")(x))
    for block, stochastic_depth in (("block2a_", False), ("block2b_", True)):
        shortcut = x
        x = layers.Conv2D(16, 1, use_bias=False, name=block + "expand_conv")(x)
        x = layers.Activation("swish", name=block + "expand_activation")(layers.BatchNormalization()(x))
        x = layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=block + "dwconv")(x)
        x = layers.Activation("swish", name=block + "activation")(layers.BatchNormalization(name=block + "bn")(x))
        squeezed = layers.GlobalAveragePooling2D(name=block + "se_squeeze")(x)
        squeezed = layers.Reshape((1, 1, 16), name=block + "se_reshape")(squeezed)
        squeezed = layers.Conv2D(2, 1, activation="swish", name=block + "se_reduce")(squeezed)
        squeezed = layers.Conv2D(16, 1, activation="sigmoid", name=block + "se_expand")(squeezed)
        x = layers.Multiply(name=block + "se_excite")([x, squeezed])
        x = layers.Conv2D(8, 1, use_bias=False, name=block + "project_conv")(x)
        x = layers.BatchNormalization(name=block + "project_bn")(x)
        if stochastic_depth:
            x = layers.Dropout(0.2, noise_shape=(None, 1, 1, 1), name=block + "drop")(x)
        x = layers.Add(name=block + "add")([x, shortcut])
    x = layers.Conv2D(32, 1, use_bias=False, name="top_conv")(x)
    x = layers.Activation("swish", name="top_activation")(layers.BatchNormalization(name="top_bn")(x))
    x = layers.Dropout(0.3, name="top_dropout")(layers.GlobalAveragePooling2D(name="avg_pool")(x))
    return keras.Model(inputs, layers.Dense(CLASSES, name="predictions")(x), name="efficientnet_like")


def resnet_like() -> keras.Model:
    """Stem, a basic block on stage 2 and a downsampling block with a projection shortcut on stage 3, head."""
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(8, 3, padding="same", name="conv1_conv")(inputs)
    x = layers.Activation("relu", name="conv1_relu")(layers.BatchNormalization(name="conv1_bn")(x))
    for stage, width, stride in ((2, 8, 1), (3, 16, 2)):
        prefix = f"conv{stage}_block1_"
        shortcut = x
        if stride != 1:
            shortcut = layers.Conv2D(width, 1, strides=stride, name=prefix + "0_conv")(x)
            shortcut = layers.BatchNormalization(name=prefix + "0_bn")(shortcut)
        y = layers.Conv2D(width, 3, strides=stride, padding="same", name=prefix + "1_conv")(x)
        y = layers.Activation("relu", name=prefix + "1_relu")(layers.BatchNormalization(name=prefix + "1_bn")(y))
        y = layers.Conv2D(width, 3, padding="same", name=prefix + "2_conv")(y)
        y = layers.BatchNormalization(name=prefix + "2_bn")(y)
        x = layers.Activation("relu", name=prefix + "out")(layers.Add(name=prefix + "add")([shortcut, y]))
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return keras.Model(inputs, layers.Dense(CLASSES, name="predictions")(x), name="resnet_like")


def raw_ops_model() -> keras.Model:
    """The issue's repro: Dense, ``x * 2.0``, Dropout, ``x[:, 0]`` (a GetItem), Dense, on (B, 5, 6) sequences."""
    inputs = keras.Input((5, 6))
    x = layers.Dense(8, name="embed")(inputs) * 2.0
    x = layers.Dropout(0.5, name="drop")(x)[:, 0]
    return keras.Model(inputs, layers.Dense(CLASSES, name="head")(x), name="raw_ops")


def nested_model() -> keras.Model:
    """A Sequential block (Dense, Dropout, Dense) inside a functional model."""
    block = keras.Sequential(
        [
            keras.Input((8,)),
            layers.Dense(12, name="inner"),
            layers.Dropout(0.3, name="inner_drop"),
            layers.Dense(8, name="inner_out"),
        ],
        name="block",
    )
    inputs = keras.Input((6,))
    x = block(layers.Dense(8, activation="relu", name="stem")(inputs))
    return keras.Model(inputs, layers.Dense(CLASSES, name="head")(x), name="nested")


def channels_first_model() -> keras.Model:
    """Convolutions on (B, C, H, W) images with a channels-first SpatialDropout2D."""
    inputs = keras.Input((3, 8, 8))
    x = layers.Conv2D(4, 3, data_format="channels_first", activation="relu", name="conv_a")(inputs)
    x = layers.Conv2D(6, 3, data_format="channels_first", name="conv_b")(x)
    x = layers.SpatialDropout2D(0.2, data_format="channels_first", name="spatial_drop")(x)
    x = layers.GlobalAveragePooling2D(data_format="channels_first")(x)
    return keras.Model(inputs, layers.Dense(CLASSES, name="head")(x), name="channels_first")


BUILDERS = {
    "mobilenet_v3": mobilenet_v3_like,
    "efficientnet": efficientnet_like,
    "resnet": resnet_like,
    "raw_ops": raw_ops_model,
    "nested": nested_model,
    "channels_first": channels_first_model,
}
