"""Mask statistics next to the paper's formulas (Durasov et al., CVPR 2021, appendix).

    python examples/mask_theory.py [--channels 512] [--n 4] [--seeds 20]

For each scale S: the mean pairwise IoU of fixed-width masks (``generate_masks``, what layers
use) against 1/(2S-1), and the mean width of the paper's algorithm (``sample_masks``) against
m*S*(1-(1-1/S)^n).
"""

from __future__ import annotations

import argparse

import numpy as np

import masksembles_core as mc

SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--m", type=int, default=100, help="ones per mask for the paper's algorithm")
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()

    print(f"Fixed-width masks: channels={args.channels}, n={args.n}, mean over {args.seeds} seeds")
    print(f"{'S':>6} {'IoU measured':>13} {'1/(2S-1)':>9} {'ones/mask':>10} {'dropout':>8} {'coverage':>9}")
    for scale in SCALES:
        stats = [mc.mask_stats(mc.generate_masks(args.channels, args.n, scale, seed=s)) for s in range(args.seeds)]
        iou = np.mean([s.mean_iou for s in stats]) if args.n > 1 else float("nan")
        print(
            f"{scale:>6.1f} {iou:>13.4f} {mc.expected_iou(scale):>9.4f} {stats[0].ones_per_mask[0]:>10d} "
            f"{stats[0].dropout_rate:>8.3f} {np.mean([s.coverage for s in stats]):>9.1%}"
        )
    print()
    print(f"The paper's algorithm: m={args.m}, n={args.n}, mean over {args.seeds * 10} draws")
    print(f"{'S':>6} {'width measured':>15} {'m*S*(1-(1-1/S)^n)':>19}")
    for scale in SCALES:
        widths = [mc.sample_masks(args.m, args.n, scale, seed=s).shape[1] for s in range(args.seeds * 10)]
        print(f"{scale:>6.1f} {np.mean(widths):>15.2f} {mc.expected_width(args.m, args.n, scale):>19.2f}")
    print()
    print("Example masks (channels=24, n=4, S=2, seed=0); # = kept channel:")
    for row in mc.generate_masks(24, args.n, 2.0, seed=0):
        print("  " + "".join("#" if v else "." for v in row))
    print(mc.mask_stats(mc.generate_masks(24, args.n, 2.0, seed=0)))


if __name__ == "__main__":
    main()
