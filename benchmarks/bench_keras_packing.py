"""Packed inference for Keras 3: all N members at about the cost of one model, on this process' backend.

    KERAS_BACKEND=jax python benchmarks/bench_keras_packing.py [--rounds 15] [--no-write]

Fixed capacity N=4, S=2 (M·S = C), float32, channels-last. Models: an MLP 784→512→512→512→10 with Masksembles before
each Dense after the first; a ResNet-like CNN on 32×32×3 (conv-BN-relu stem at 32 channels, two residual blocks of
32 and 64 channels with masks between their convolutions, global pooling, masks, Dense); a MobileNet-like CNN
(expand 1×1, depthwise 3×3, grouped 1×1 projection with 2 groups, residual; masks after the stem and after the
expansion); a Transformer of two pre-norm blocks on 64 tokens of 48 features (Dense to 96, LayerNormalization,
MultiHeadAttention with 3 heads of 32, GELU MLP of 384 with masks before and after its first Dense, residual sums,
then LayerNormalization, average pooling, masks, Dense). The attention is folded into the heads (once for every
member in the first block, which reads no mask; the members' heads side by side in the second) and its multiply-adds
(projections, scores, weighted sums) are in the MAC ratio. For batch sizes 1, 32, 256:
``pack(model, x, program="packed").predict_on_batch(x)`` ÷ one ``predict_on_batch`` of the same network without
Masksembles (medians of interleaved rounds,
``_report.interleaved_medians``), next to the MAC ratio of their Dense, convolution and attention layers and the one-hot
products that move channels (``packed.macs["packed"] + packed.macs["moves"]`` ÷ one model's): the floor of the time
ratio where both run at the same speed per MAC.
Also the seconds ``pack`` takes (``program="packed"`` and ``"auto"``) on a batch of 32.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import keras
import numpy as np
from _report import arguments, interleaved_medians, machine, publish
from keras import layers

import masksembles_core as mc
import masksembles_keras as mk

N, SCALE = 4, 2.0
BATCHES = (1, 32, 256)


def masks(enabled: bool, seed: int) -> Callable[[keras.KerasTensor], keras.KerasTensor]:
    return mk.Masksembles(N, SCALE, seed=seed) if enabled else (lambda x: x)


def mlp(enabled: bool) -> keras.Model:
    inputs = keras.Input((784,))
    x = layers.Dense(512, activation="relu")(inputs)
    for i in range(2):
        x = layers.Dense(512, activation="relu")(masks(enabled, i)(x))
    return keras.Model(inputs, layers.Dense(10)(masks(enabled, 2)(x)))


def conv_bn(x: keras.KerasTensor, channels: int, strides: int = 1) -> keras.KerasTensor:
    return layers.BatchNormalization()(layers.Conv2D(channels, 3, strides, padding="same", use_bias=False)(x))


def resnet(enabled: bool) -> keras.Model:
    inputs = keras.Input((32, 32, 3))
    x = layers.ReLU()(conv_bn(inputs, 32))
    for seed, channels in enumerate((32, 64)):
        if channels != x.shape[-1]:
            x = layers.ReLU()(conv_bn(x, channels, strides=2))
        y = masks(enabled, seed)(layers.ReLU()(conv_bn(x, channels)))
        x = layers.ReLU()(layers.Add()([x, conv_bn(y, channels)]))
    x = masks(enabled, 2)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, layers.Dense(10)(x))


def mobilenet(enabled: bool) -> keras.Model:
    inputs = keras.Input((32, 32, 3))
    x = masks(enabled, 0)(layers.ReLU(6.0)(conv_bn(inputs, 32, strides=2)))
    for seed in range(2):
        y = layers.ReLU(6.0)(layers.BatchNormalization()(layers.Conv2D(128, 1, use_bias=False)(x)))
        y = masks(enabled, seed + 1)(y)
        y = layers.ReLU(6.0)(layers.BatchNormalization()(layers.DepthwiseConv2D(3, padding="same")(y)))
        x = layers.Add()([x, layers.BatchNormalization()(layers.Conv2D(32, 1, groups=2)(y))])
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))


def transformer(enabled: bool) -> keras.Model:
    inputs = keras.Input((64, 48))
    x = layers.Dense(96)(inputs)
    for seed in range(2):
        y = layers.LayerNormalization()(x)
        x = layers.Add()([x, layers.MultiHeadAttention(3, 32)(y, y)])
        y = masks(enabled, 2 * seed)(layers.LayerNormalization()(x))
        y = masks(enabled, 2 * seed + 1)(layers.Dense(384, activation="gelu")(y))
        x = layers.Add()([x, layers.Dense(96)(y)])
    x = masks(enabled, 4)(layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x)))
    return keras.Model(inputs, layers.Dense(10)(x))


def randomized(model: keras.Model) -> keras.Model:
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape) * 0.1)
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape))
    return model


def build(builder: Callable[[bool], keras.Model], enabled: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    return randomized(builder(enabled))


def main() -> None:
    args = arguments(rounds=15)
    backend = keras.backend.backend()
    rows, builds = [], []
    models = (("MLP", mlp), ("ResNet-like", resnet), ("MobileNet-like", mobilenet), ("Transformer", transformer))
    for name, builder in models:
        model, single = build(builder, True), build(builder, False)
        shape = model.inputs[0].shape[1:]
        rng = np.random.default_rng(0)
        example = rng.standard_normal((32, *shape)).astype("float32")
        seconds = {}
        for program in ("packed", "auto"):
            start = time.perf_counter()
            packed = mk.pack(model, example, program=program)
            seconds[program] = time.perf_counter() - start
        packed = mk.pack(model, example, program="packed")
        mac_ratio = (packed.macs["packed"] + packed.macs.get("moves", 0)) / (packed.macs["dense"] / N)
        builds.append(
            f"| {name} | {seconds['packed']:.1f} | {seconds['auto']:.1f} | {seconds['auto'] / seconds['packed']:.2f}× "
            f"| {packed.fallbacks or '—'} |"
        )
        for batch in BATCHES:
            x = rng.standard_normal((batch, *shape)).astype("float32")
            tiled = mc.tile(x, N)  # the member-stacked batch predict runs the model on
            times = interleaved_medians(
                {
                    "single": lambda s=single, v=x: s.predict_on_batch(v),
                    "tiled": lambda m=model, v=tiled: m.predict_on_batch(v),
                    "packed": lambda p=packed, v=x: p.predict_on_batch(v),
                },
                rounds=args.rounds,
            )
            ratio = times["packed"] / times["single"]
            rows.append(
                f"| {name} | {batch} | {times['single'] * 1e3:.2f} | {ratio:.2f}× | {mac_ratio:.2f}× "
                f"| {ratio / mac_ratio:.2f} | {times['packed'] / times['tiled']:.2f}× |"
            )
    lines = [
        f"## Packed inference, Keras 3 on {backend} (CPU)",
        "",
        f"Keras {keras.__version__}, float32, N={N}, S={SCALE} at fixed capacity (M·S = C); `predict_on_batch` "
        f"(compiled as `model.predict` compiles it), medians of {args.rounds} interleaved rounds on {machine()}. "
        "Packed ÷ one forward of the same network without Masksembles; MACs: the packed model's Dense, "
        "convolution and attention multiply-adds and its one-hot channel moves' ÷ one model's, the floor of the "
        "time ratio at equal speed per MAC; packed ÷ tiled: ÷ the masked model on the member-stacked batch "
        "(`predict_on_batch(tile(x, N))`, what `predict` computes, compiled alike). Targets (issue #39): "
        "time ÷ MACs ≤ 1.3, and packed ÷ tiled ≤ 0.7 at batch 32 and 256.",
        "",
        "| model | batch | single (ms) | packed ÷ single | MACs | time ÷ MACs | packed ÷ tiled |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Seconds `pack` takes on a batch of 32 (capture, build, verification; `auto` also times both programs):",
        "",
        "| model | packed (s) | auto (s) | auto ÷ packed | fallbacks |",
        "|---|---:|---:|---:|---|",
        *builds,
    ]
    publish(f"packing-keras-{backend}", "\n".join(lines), write=not args.no_write)


if __name__ == "__main__":
    main()
